"""Name -> function registries for advantage estimators and policy losses.

The controller picks an algorithm's pieces by name from the config (``algorithm.advantage:
grpo``, ``actor.policy_loss: ppo``); the built-ins register themselves when
``megarl.algorithms`` is imported. Built-in advantage estimators: ``gae``, ``grpo``,
``drgrpo``, ``rloo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``remax``,
``prime``. Built-in policy losses: ``ppo``, ``gspo``, ``vanilla``.

Calling conventions (all arguments by keyword):

* advantage estimator: ``fn(*, token_rewards, response_mask, <its own inputs: index, values,
  baseline_rewards, process_rewards, gamma, ...>) -> (advantages, returns)``, each
  ``[batch, response_len]`` and 0 on padding. ``token_rewards`` holds the outcome score on the
  last response token (see ``scores_to_token_rewards``) plus any per-token terms (a KL penalty);
  outcome-based estimators use ``score_i = sum_t token_rewards[i, t]``.
* policy loss: ``fn(*, logp, old_logp, advantages, response_mask, loss_agg_mode, max_len,
  <its own hyper-parameters>) -> (loss, metrics)`` with a scalar loss and a dict of detached
  scalar tensors.

Adding your own takes a few lines::

    from megarl.algorithms import get_advantage, register_advantage

    @register_advantage("batch_mean_baseline")
    def batch_mean_baseline(*, token_rewards, response_mask):
        # score minus the batch's mean score, on every response token
        scores = (token_rewards * response_mask).sum(-1)
        adv = (scores - scores.mean())[:, None] * response_mask
        return adv, adv

    adv, ret = get_advantage("batch_mean_baseline")(token_rewards=r, response_mask=m)

``register_policy_loss("name")`` works the same way. Registering a taken name raises
ValueError unless ``override=True`` is passed.
"""

from __future__ import annotations

from typing import Callable

_ADVANTAGES: dict[str, Callable] = {}
_POLICY_LOSSES: dict[str, Callable] = {}


def _register(table: dict[str, Callable], kind: str, name: str, override: bool) -> Callable[[Callable], Callable]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a {kind} name must be a non-empty string, got {name!r}")

    def decorator(fn: Callable) -> Callable:
        if name in table and not override and table[name] is not fn:
            raise ValueError(
                f"{kind} {name!r} is already registered (to {table[name].__module__}."
                f"{table[name].__qualname__}); pick another name or pass override=True"
            )
        table[name] = fn
        return fn

    return decorator


def _get(table: dict[str, Callable], kind: str, name: str) -> Callable:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; registered: {sorted(table)}") from None


def register_advantage(name: str, override: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: register an advantage estimator under ``name``."""
    return _register(_ADVANTAGES, "advantage estimator", name, override)


def register_policy_loss(name: str, override: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: register a policy loss under ``name``."""
    return _register(_POLICY_LOSSES, "policy loss", name, override)


def get_advantage(name: str) -> Callable:
    """The advantage estimator registered as ``name``; ValueError listing the names otherwise."""
    return _get(_ADVANTAGES, "advantage estimator", name)


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered as ``name``; ValueError listing the names otherwise."""
    return _get(_POLICY_LOSSES, "policy loss", name)


def list_advantages() -> list[str]:
    return sorted(_ADVANTAGES)


def list_policy_losses() -> list[str]:
    return sorted(_POLICY_LOSSES)
