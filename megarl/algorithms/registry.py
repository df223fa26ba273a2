"""Name -> entry registries for advantage estimators and policy losses.

The controller picks an algorithm's pieces by name from the config (``algorithm.advantage:
grpo``, ``actor.policy_loss: ppo``); the built-ins register themselves when
``megarl.algorithms`` is imported. Built-in advantage estimators: ``gae``, ``grpo``,
``drgrpo``, ``rloo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``remax``,
``prime``. Built-in policy losses: ``ppo``, ``gspo``, ``vanilla``, ``sft``.

Registration declares what an entry takes and needs; callers pass exactly that, by keyword:

* advantage estimator: ``fn(*, token_rewards, response_mask, <its declared inputs>) ->
  (advantages, returns)``, each ``[batch, response_len]`` and 0 on padding. ``token_rewards``
  holds the outcome score on the last response token (see ``scores_to_token_rewards``) plus any
  per-token terms (a KL penalty); outcome-based estimators use ``score_i = sum_t
  token_rewards[i, t]``. ``inputs`` are names from ``ADVANTAGE_INPUTS``: ``index`` (the prompt
  of each sample: samples of one prompt form a group), ``values`` (the critic's, before the
  update), ``gamma``, ``lam``, ``norm_by_std`` (``algorithm.*``), ``baseline_rewards``,
  ``process_rewards``. ``needs_critic=True``: config validation requires ``critic.enabled``;
  ``needs_groups=True``: it requires ``rollout.n >= 2``.
* policy loss: ``fn(*, logp, old_logp, advantages, response_mask, loss_agg_mode, max_len,
  <its declared options>) -> (loss, metrics)`` with a scalar loss and a dict of detached scalar
  tensors. ``options`` are names from ``POLICY_LOSS_OPTIONS`` (``clip_low``, ``clip_high``,
  ``clip_ratio_c``: the actor's clip settings); an option configured as None is left out, so
  the function's default applies.

A caller that lacks a declared input gets a ValueError naming the entry and the input; a
declared name the function does not accept is refused at registration.

Adding your own takes a few lines::

    from megarl.algorithms import advantage_spec, group_stats, register_advantage

    @register_advantage("prompt_mean_baseline", inputs=("index",), needs_groups=True)
    def prompt_mean_baseline(*, token_rewards, response_mask, index):
        # score minus the mean score of the same prompt's samples, on every response token
        scores = (token_rewards * response_mask).sum(-1)
        adv = (scores - group_stats(scores, index).mean)[:, None] * response_mask
        return adv, adv

    estimator = advantage_spec("prompt_mean_baseline")
    adv, ret = estimator(token_rewards=r, response_mask=m, index=["a", "a"], gamma=1.0)

(``gamma`` is not declared, so it is not passed.) ``register_policy_loss("name",
options=(...))`` works the same way. Registering a taken name raises ValueError unless
``override=True`` is passed.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

# What the trainer offers an advantage estimator beside token_rewards and response_mask.
ADVANTAGE_INPUTS = ("index", "values", "gamma", "lam", "norm_by_std", "baseline_rewards", "process_rewards")
# What the actor's loss offers a policy loss beside its fixed arguments.
POLICY_LOSS_OPTIONS = ("clip_low", "clip_high", "clip_ratio_c")


@dataclasses.dataclass(frozen=True)
class AdvantageSpec:
    """A registered advantage estimator: its function, its declared inputs and needs."""

    name: str
    fn: Callable
    inputs: tuple[str, ...] = ()
    needs_critic: bool = False  # reads the critic's values: validation requires critic.enabled
    needs_groups: bool = False  # compares samples of one prompt: validation requires rollout.n >= 2

    def __call__(self, *, token_rewards: Any, response_mask: Any, **available: Any) -> tuple[Any, Any]:
        """``fn`` on ``token_rewards``, ``response_mask`` and the declared inputs, taken from
        ``available`` (what the caller has; None counts as absent, undeclared ones are not passed)."""
        missing = [key for key in self.inputs if available.get(key) is None]
        if missing:
            raise ValueError(f"advantage estimator {self.name!r} needs input(s) {missing}, which the caller "
                             f"does not provide (it has {sorted(k for k, v in available.items() if v is not None)})")
        return self.fn(token_rewards=token_rewards, response_mask=response_mask,
                       **{key: available[key] for key in self.inputs})


@dataclasses.dataclass(frozen=True)
class PolicyLossSpec:
    """A registered policy loss: its function and the options it takes."""

    name: str
    fn: Callable
    options: tuple[str, ...] = ()

    def __call__(self, *, logp: Any, old_logp: Any, advantages: Any, response_mask: Any, loss_agg_mode: str,
                 max_len: int | None, **offered: Any) -> tuple[Any, dict]:
        """``fn`` on the fixed arguments and the declared options, taken from ``offered``
        (undeclared ones are not passed; a None value leaves the function's default)."""
        missing = [key for key in self.options if key not in offered]
        if missing:
            raise ValueError(f"policy loss {self.name!r} takes option(s) {missing}, which the caller does not "
                             f"provide (it has {sorted(offered)})")
        return self.fn(logp=logp, old_logp=old_logp, advantages=advantages, response_mask=response_mask,
                       loss_agg_mode=loss_agg_mode, max_len=max_len,
                       **{key: offered[key] for key in self.options if offered[key] is not None})


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionSpec:
    """A registered rollout correction: ``fn(*, log_ratio, response_mask, low, high) -> weights``."""

    name: str
    fn: Callable

    def __call__(self, *, log_ratio: Any, response_mask: Any, low: float, high: float) -> Any:
        return self.fn(log_ratio=log_ratio, response_mask=response_mask, low=low, high=high)


_ADVANTAGES: dict[str, AdvantageSpec] = {}
_POLICY_LOSSES: dict[str, PolicyLossSpec] = {}
_ROLLOUT_CORRECTIONS: dict[str, RolloutCorrectionSpec] = {}


def _check_declared(kind: str, name: str, fn: Callable, declared: tuple[str, ...], known: tuple[str, ...]) -> None:
    unknown = [key for key in declared if key not in known]
    if unknown:
        raise ValueError(f"{kind} {name!r}: unknown input(s) {unknown}; declare names from {list(known)}")
    params = inspect.signature(fn).parameters  # once, at registration: calls pass exactly `declared`
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    lacking = [key for key in declared if key not in params or params[key].kind is inspect.Parameter.POSITIONAL_ONLY]
    if lacking:
        raise ValueError(f"{kind} {name!r} declares input(s) {lacking} that {fn.__qualname__} does not accept "
                         "as keyword arguments; add them to its signature or drop them from the declaration")


def _register(table: dict, kind: str, name: str, override: bool, make: Callable[[Callable], Any]):
    if not isinstance(name, str) or not name:
        raise ValueError(f"a {kind} name must be a non-empty string, got {name!r}")

    def decorator(fn: Callable) -> Callable:
        if name in table and not override and table[name].fn is not fn:
            taken = table[name].fn
            raise ValueError(
                f"{kind} {name!r} is already registered (to {taken.__module__}.{taken.__qualname__}); "
                "pick another name or pass override=True"
            )
        table[name] = make(fn)
        return fn

    return decorator


def register_advantage(name: str, *, inputs: tuple[str, ...] = (), needs_critic: bool = False,
                       needs_groups: bool = False, override: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: register an advantage estimator under ``name`` that takes ``inputs`` (names
    from ``ADVANTAGE_INPUTS``) besides ``token_rewards`` and ``response_mask``, and needs a
    critic / groups of several samples per prompt."""
    inputs = tuple(inputs)

    def make(fn: Callable) -> AdvantageSpec:
        _check_declared("advantage estimator", name, fn, inputs, ADVANTAGE_INPUTS)
        return AdvantageSpec(name, fn, inputs, needs_critic=needs_critic, needs_groups=needs_groups)

    return _register(_ADVANTAGES, "advantage estimator", name, override, make)


def register_policy_loss(name: str, *, options: tuple[str, ...] = (),
                         override: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: register a policy loss under ``name`` that takes ``options`` (names from
    ``POLICY_LOSS_OPTIONS``) besides its fixed arguments."""
    options = tuple(options)

    def make(fn: Callable) -> PolicyLossSpec:
        _check_declared("policy loss", name, fn, options, POLICY_LOSS_OPTIONS)
        return PolicyLossSpec(name, fn, options)

    return _register(_POLICY_LOSSES, "policy loss", name, override, make)


def register_rollout_correction(name: str, *, override: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: register a rollout correction under ``name``: ``fn(*, log_ratio, response_mask,
    low, high)`` -> per-token weights >= 0 (see ``megarl.algorithms.rollout_correction``)."""

    def make(fn: Callable) -> RolloutCorrectionSpec:
        _check_declared("rollout correction", name, fn, ("log_ratio", "response_mask", "low", "high"),
                        ("log_ratio", "response_mask", "low", "high"))
        return RolloutCorrectionSpec(name, fn)

    return _register(_ROLLOUT_CORRECTIONS, "rollout correction", name, override, make)


def _get(table: dict, kind: str, name: str):
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; registered: {sorted(table)}") from None


def advantage_spec(name: str) -> AdvantageSpec:
    """The advantage estimator registered as ``name`` with its declarations; ValueError listing
    the names otherwise."""
    return _get(_ADVANTAGES, "advantage estimator", name)


def policy_loss_spec(name: str) -> PolicyLossSpec:
    """The policy loss registered as ``name`` with its declarations; ValueError listing the
    names otherwise."""
    return _get(_POLICY_LOSSES, "policy loss", name)


def rollout_correction_spec(name: str) -> RolloutCorrectionSpec:
    """The rollout correction registered as ``name``; ValueError listing the names otherwise."""
    return _get(_ROLLOUT_CORRECTIONS, "rollout correction", name)


def get_advantage(name: str) -> Callable:
    """The function of the advantage estimator ``name`` (to call with explicit arguments)."""
    return advantage_spec(name).fn


def get_policy_loss(name: str) -> Callable:
    """The function of the policy loss ``name`` (to call with explicit arguments)."""
    return policy_loss_spec(name).fn


def list_advantages() -> list[str]:
    return sorted(_ADVANTAGES)


def list_policy_losses() -> list[str]:
    return sorted(_POLICY_LOSSES)


def list_rollout_corrections() -> list[str]:
    return sorted(_ROLLOUT_CORRECTIONS)
