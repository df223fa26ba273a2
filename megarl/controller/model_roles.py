"""The Megatron models a run builds, one ``ModelSpec`` per role (actor, reference, critic,
reward model), and the config arithmetic they share with the step: how many optimizer steps an
RL step makes, and whether the actor recomputes the pre-update log-probs."""

from __future__ import annotations

import dataclasses

from megarl.config.schema import RunConfig


def model_specs(cfg: RunConfig, model_dir: str) -> list:
    """The ``ModelSpec`` of every Megatron model the run builds from ``model_dir``, the actor's first."""
    from megarl.workers.batch import MicroBatching
    from megarl.workers.losses import LossSettings
    from megarl.workers.megatron_worker import ModelSpec

    a = cfg.actor
    steps_per_rl_step = a.ppo_epochs * minibatches_per_step(cfg, a.mini_batch_size)
    kl, correction = a.kl_loss, cfg.algorithm.rollout_correction
    actor_loss = LossSettings(policy_loss=a.policy_loss, loss_agg_mode=a.loss_agg_mode,
                              max_len=cfg.max_response_length, clip_ratio_low=a.clip_ratio_low,
                              clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
                              entropy_coef=a.entropy_coef, kl_coef=kl.coef if kl.enabled else 0.0,
                              kl_estimator=kl.estimator, kl_clamp=kl.clamp,
                              mismatch_bounds=None if recomputes_old_logp(cfg) else (correction.low, correction.high))
    packed, shared = a.sequence_packing, cfg.shared_prompt_rows
    specs = [ModelSpec("actor", model_dir, a.layout,
                       MicroBatching(a.micro_batch_size, a.max_tokens_per_micro_batch, packed, shared),
                       a.optim, cfg.trainer.total_steps * steps_per_rl_step, actor_loss, cfg.model.dtype,
                       routing_replay=a.routing_replay)]
    if cfg.needs_reference:
        specs.append(ModelSpec("ref", model_dir, cfg.layout_for("ref"),
                               MicroBatching(cfg.ref.micro_batch_size, packed=packed, shared_prompts=shared),
                               dtype=cfg.model.dtype))
    if cfg.critic.enabled:
        c = cfg.critic
        specs.append(ModelSpec("critic", c.model_path or model_dir, cfg.layout_for("critic"),
                               MicroBatching(c.micro_batch_size, c.max_tokens_per_micro_batch, packed, shared), c.optim,
                               cfg.trainer.total_steps * c.ppo_epochs * minibatches_per_step(cfg, c.mini_batch_size),
                               LossSettings(loss_agg_mode=c.loss_agg_mode, value_clip=c.value_clip,
                                            max_len=cfg.max_response_length), cfg.model.dtype))
    if cfg.reward_model.enabled:
        rm = cfg.reward_model
        specs.append(ModelSpec("reward_model", rm.model_path, cfg.layout_for("reward_model"),
                               MicroBatching(rm.micro_batch_size, packed=packed, shared_prompts=shared),
                               dtype=cfg.model.dtype))
    # what registers the losses a worker runs, imported there too; how megatron trains (actor.*)
    common = dict(imports=tuple(cfg.imports), moe_token_dispatcher=cfg.moe_token_dispatcher, recompute=a.recompute,
                  overlap_grad_reduce=cfg.overlap_grad_reduce)
    return [dataclasses.replace(spec, **common) for spec in specs]


def minibatches_per_step(cfg: RunConfig, mini_batch_size: int | None) -> int:
    """Optimizer steps per pass over a step's batch (one per mini-batch)."""
    return max(1, cfg.data.batch_size // (mini_batch_size or cfg.data.batch_size))


def recomputes_old_logp(cfg: RunConfig) -> bool:
    """Whether the actor recomputes the pre-update log-probs (a forward pass before the update):
    off-policy passes (several epochs or mini-batches), the KL reward penalty, PPO with a critic
    and a rollout correction use them; a single on-policy GRPO pass uses the update's own forward
    (detached) instead of a second one; with ``rollout_correction.bypass`` the rollout's are used."""
    a, alg = cfg.actor, cfg.algorithm
    if alg.rollout_correction.bypass:
        return False
    return (a.ppo_epochs * minibatches_per_step(cfg, a.mini_batch_size) > 1 or alg.kl_penalty.enabled
            or cfg.critic.enabled or alg.rollout_correction.method != "none" or cfg.rollout.staleness > 0)
