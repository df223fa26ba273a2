"""RL algorithm pieces as small pure torch functions over padded batches with response masks.

Advantage estimators (``advantages``), policy/value losses and entropy (``policy_loss``), KL
estimators and controllers (``kl``), loss aggregation (``aggregation``), DAPO filters
(``filters``), rollout corrections and mismatch metrics (``rollout_correction``), and the name
registry (``registry``). Importing this package registers the
built-in estimators and losses; see ``registry`` for the calling conventions and for how to
register your own.
"""

from megarl.algorithms.advantages import (
    GroupStats,
    compute_drgrpo_outcome_advantage,
    compute_gae_advantage,
    compute_grpo_outcome_advantage,
    compute_prime_advantage,
    compute_reinforce_plus_plus_advantage,
    compute_reinforce_plus_plus_baseline_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
    discounted_returns,
    group_stats,
    implicit_process_rewards,
    scores_to_token_rewards,
    sequence_scores,
)
from megarl.algorithms.aggregation import (
    LOSS_AGG_MODES,
    agg_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from megarl.algorithms.filters import dynamic_sampling_mask, overlong_reward_penalty, response_lengths
from megarl.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_estimate,
    kl_loss,
)
from megarl.algorithms.policy_loss import (
    entropy_from_logits,
    gspo_policy_loss,
    masked_entropy,
    ppo_policy_loss,
    sft_loss,
    value_loss,
    vanilla_policy_loss,
)
from megarl.algorithms.registry import (
    ADVANTAGE_INPUTS,
    POLICY_LOSS_OPTIONS,
    AdvantageSpec,
    PolicyLossSpec,
    RolloutCorrectionSpec,
    advantage_spec,
    get_advantage,
    get_policy_loss,
    list_advantages,
    list_policy_losses,
    list_rollout_corrections,
    policy_loss_spec,
    register_advantage,
    register_policy_loss,
    register_rollout_correction,
    rollout_correction_spec,
)
from megarl.algorithms.rollout_correction import rollout_correction_weights, rollout_mismatch_metrics

__all__ = [
    "LOSS_AGG_MODES", "agg_loss", "masked_mean", "masked_sum", "masked_var", "masked_whiten",
    "ADVANTAGE_INPUTS", "POLICY_LOSS_OPTIONS", "AdvantageSpec", "PolicyLossSpec", "advantage_spec",
    "get_advantage", "get_policy_loss", "list_advantages", "list_policy_losses", "policy_loss_spec",
    "register_advantage", "register_policy_loss",
    "RolloutCorrectionSpec", "list_rollout_corrections", "register_rollout_correction", "rollout_correction_spec",
    "rollout_correction_weights", "rollout_mismatch_metrics",
    "GroupStats", "compute_drgrpo_outcome_advantage", "compute_gae_advantage",
    "compute_grpo_outcome_advantage", "compute_prime_advantage",
    "compute_reinforce_plus_plus_advantage", "compute_reinforce_plus_plus_baseline_advantage",
    "compute_remax_advantage", "compute_rloo_advantage", "discounted_returns", "group_stats",
    "implicit_process_rewards", "scores_to_token_rewards", "sequence_scores",
    "entropy_from_logits", "gspo_policy_loss", "masked_entropy", "ppo_policy_loss", "value_loss",
    "sft_loss",
    "vanilla_policy_loss",
    "KL_ESTIMATORS", "AdaptiveKLController", "FixedKLController", "apply_kl_penalty",
    "kl_estimate", "kl_loss",
    "dynamic_sampling_mask", "overlong_reward_penalty", "response_lengths",
]
