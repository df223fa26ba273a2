"""Rewards: function rewards chosen by data source, run with timeouts; the reward-model protocol.

* ``gsm8k``, ``math_answer``, ``exact_match``, ``arithmetic``: the scoring rules (pure functions).
* ``registry``: ``register_reward`` (decorator), data source -> reward mapping,
  ``load_reward_function("module:function")`` for user functions.
* ``dispatch``: ``compute_rewards`` / ``RewardRunner``, which score a batch, turn exceptions and
  timeouts into 0.0 plus counts, and never hang on a user function.
* ``reward_model``: the ``RewardModel`` protocol (implemented with the workers).

Nothing here imports torch at module level, so reward worker processes start quickly.
"""

from megarl.rewards import arithmetic, exact_match, gsm8k, math_answer
from megarl.rewards.dispatch import BACKENDS, RewardRunner, compute_rewards
from megarl.rewards.registry import (
    data_source_mapping,
    get_reward,
    load_reward_function,
    register_reward,
    registered_rewards,
    resolve_reward,
    reward_for_data_source,
)
from megarl.rewards.reward_model import RewardModel

__all__ = [
    "BACKENDS",
    "RewardModel",
    "RewardRunner",
    "arithmetic",
    "compute_rewards",
    "data_source_mapping",
    "exact_match",
    "get_reward",
    "gsm8k",
    "load_reward_function",
    "math_answer",
    "register_reward",
    "registered_rewards",
    "resolve_reward",
    "reward_for_data_source",
]
