"""The RL trainer: the algorithm's dataflow, one step at a time::

    generate -> reward -> reference / critic forward -> advantages -> update -> weight sync

GRPO-style runs (no critic) take the group baseline from the rewards; PPO (``critic.enabled``)
adds the critic's values, GAE, and the critic's update. The pieces it composes: a ``Run`` (Ray,
the Megatron workers, checkpoints, the step loop), a ``RolloutManager`` (the SGLang engines and
the weight sync) and the prompt data with its rewards.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch

from megarl.config.schema import RunConfig
from megarl.controller.dynamic_sampling import GroupFiller
from megarl.controller.model_roles import recomputes_old_logp
from megarl.controller.rollout_manager import RolloutManager
from megarl.controller.run import Run
from megarl.controller.step_metrics import PhaseTimer, rl_step_metrics, train_tflops_per_s


class RLTrainer:
    """Builds the workers and engines of ``cfg`` (validated) and runs ``trainer.total_steps`` RL steps."""

    HEADLINE = ("reward/mean", "reward")  # the metric the console line summarises

    def __init__(self, cfg: RunConfig, log: Callable[[str], None] = print):
        self.cfg, self.log = cfg, log
        self.run = Run(cfg, log)
        self.rollout: RolloutManager | None = None
        self._build_data()
        self.run.start_workers()
        self.rollout = RolloutManager(cfg, log, self.run.workers, self.run.model_dir, self.run.hf_config,
                                      self.run.actor_layer_spec, self.loader, self.run.tokenizer, self.agent,
                                      self.run.timeline, self.run.faults)

    @property
    def step(self) -> int:
        return self.run.step

    def _build_data(self) -> None:
        from megarl.algorithms import AdaptiveKLController, FixedKLController
        from megarl.data.dataset import PromptDataset, PromptLoader
        from megarl.rewards.dispatch import RewardRunner

        d, m = self.cfg.data, self.cfg.rollout.multi_turn
        tokenizer = self.run.tokenizer
        self.agent = None
        if m.enabled:  # multi-turn rollouts with tools: the prompts show the tools' schemas
            from megarl.agent import AgentLoop, AgentSettings, ToolLimits, ToolRegistry

            limits = ToolLimits(timeout_s=m.tool_timeout_s, memory_mb=m.tool_memory_mb, cpu_s=m.tool_timeout_s,
                                max_output_chars=m.tool_max_output_chars)
            self.agent = AgentLoop(tokenizer, ToolRegistry.from_names(m.tools, limits),
                                   AgentSettings(m.max_turns, m.max_total_tokens, m.tool_format, d.chat_template))
        dataset = PromptDataset(d.train_files, tokenizer, prompt_key=d.prompt_key,
                                ground_truth_key=d.ground_truth_key, data_source_key=d.data_source_key,
                                default_data_source=d.default_data_source, extra_info_key=d.extra_info_key,
                                prompt_template=d.prompt_template, chat_template=d.chat_template,
                                max_prompt_length=d.max_prompt_length, tools=self.agent.schemas if self.agent else None)
        self.loader = PromptLoader(dataset, d.batch_size, seed=d.seed, shuffle=d.shuffle)
        r = self.cfg.reward
        self.rewards = RewardRunner(r.functions, r.default, r.timeout_s, r.backend, r.num_workers)
        kl = self.cfg.algorithm.kl_penalty
        self.kl_controller = (AdaptiveKLController(kl.coef, kl.target, kl.horizon) if kl.controller == "adaptive"
                              else FixedKLController(kl.coef))

    # ------------------------------------------------------------------ the run

    def fit(self) -> list[dict[str, float]]:
        """Run (or continue) until ``trainer.total_steps``; returns this process's step metrics."""
        return self.run.fit(self, on_resume=lambda: self.rollout.sync_weights(self.step))

    def run_state(self) -> dict:
        """What a checkpoint keeps beside the models: the data position (before the prompts of any
        generation running ahead: a resumed run generates them again) and the KL controller."""
        return {"data": self.rollout.data_state(self.step), "kl_controller": self.kl_controller.state_dict()}

    def load_run_state(self, state: dict) -> None:
        self.loader.load_state_dict(state["data"])
        self.kl_controller.load_state_dict(state["kl_controller"])

    def export_hf(self, target: str | None = None) -> str:
        return self.run.export_hf(target)

    def close(self) -> None:
        """Stop the engines, the reward workers, and Ray with every Megatron worker."""
        if self.rollout is not None:
            self.rollout.close()
        if hasattr(self, "rewards"):
            self.rewards.close()
        self.run.close()

    # ------------------------------------------------------------------ one step

    def train_step(self) -> dict[str, float]:
        """generate -> reward -> reference (+ critic values) -> advantages -> update(s) -> weight sync."""
        cfg, workers = self.cfg, self.run.workers
        metrics: dict[str, float] = {}
        timed = PhaseTimer(metrics, self.run.timeline, self.step + 1)
        start = time.perf_counter()
        with timed("generate"):  # ahead of training: the wait for the batch generated meanwhile
            batch = self.rollout.next_batch(self.step)
        self.rollout.release_memory()  # colocated on GPUs: the engines' memory, until the sync
        with timed("reward"):
            scores, reward_stats = self.score(batch)
        if cfg.algorithm.dynamic_sampling.enabled:
            with timed("dynamic_sampling"):
                batch, scores, reward_stats = self.fill_informative_groups(batch, scores, reward_stats, metrics)
        scores = self.shape_rewards(batch, scores, metrics)
        wanted = {}  # batch key -> (role, output) of the forward-only passes
        if cfg.needs_reference:
            wanted["ref_logp"] = ("ref", "logp")
        if recomputes_old_logp(cfg):
            wanted["old_logp"] = ("actor", "logp")
        elif cfg.algorithm.rollout_correction.bypass:
            batch["old_logp"] = batch["rollout_logp"]
        if cfg.critic.enabled:
            wanted["old_values"] = ("critic", "values")
        if wanted:
            with timed("forward"):
                batch.update(workers.forward(batch, wanted))
        self.advantages(batch, scores, metrics)
        if cfg.trainer.save_rollouts_every and (self.step + 1) % cfg.trainer.save_rollouts_every == 0:
            self.save_rollouts(batch, scores, self.step + 1)
        with timed("update"):
            metrics.update(workers.update(batch, self.step + 1))
        with timed("sync"):  # (released engines take their memory back around it)
            metrics.update(self.rollout.sync_weights(self.step + 1))
        metrics.update(rl_step_metrics(batch, scores, reward_stats, self.step, time.perf_counter() - start))
        metrics["perf/train_tflops_per_s"] = train_tflops_per_s(self.run.hf_config, batch, metrics["time/update_s"])
        return metrics

    def score(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """One score per sample: the reward model's output at the sample's last token when
        ``reward_model.enabled``, else the data source's reward function."""
        if self.cfg.reward_model.enabled:
            values = self.run.workers.forward(batch, {"score": ("reward_model", "values")})["score"]
            last = (batch["response_lengths"] - 1).clamp(min=0)
            return values[torch.arange(len(last)), last].float(), {}
        if self.run.faults.fire("kill_reward_worker", self.step + 1):
            self.log(f"megarl: fault injection: a reward worker dies as it is to score step {self.step + 1}")
            self.rewards.crash_a_worker_in_the_next_batch()
        scores, stats = self.rewards(batch["data_source"], batch["responses"], batch["ground_truth"],
                                     batch["extra_info"])
        return scores.float(), stats

    def fill_informative_groups(self, batch: dict, scores: torch.Tensor, reward_stats: dict,
                                metrics: dict) -> tuple[dict, torch.Tensor, dict]:
        """DAPO dynamic sampling (``megarl.controller.dynamic_sampling``): more prompts are drawn,
        generated and scored until ``data.batch_size`` groups with differing scores are in, or
        ``algorithm.dynamic_sampling.max_rounds`` generations were made."""
        filler = GroupFiller(self.cfg.data.batch_size)
        filler.add(batch, scores, reward_stats)
        while not filler.full and filler.rounds < self.cfg.algorithm.dynamic_sampling.max_rounds:
            more = self.rollout.next_batch(self.step, draw=filler.rounds)  # resyncs released engines first
            self.rollout.release_memory()
            filler.add(more, *self.score(more))
        batch, scores, reward_stats, sampling = filler.batch()
        metrics.update(sampling)
        return batch, scores, reward_stats

    def shape_rewards(self, batch: dict, scores: torch.Tensor, metrics: dict) -> torch.Tensor:
        """The scores the advantages are computed from: with ``algorithm.overlong_penalty`` DAPO's soft
        overlong punishment added (0 up to the buffer before the most response tokens, falling
        linearly to -penalty_factor at the limit)."""
        o = self.cfg.algorithm.overlong_penalty
        if not o.enabled:
            return scores
        from megarl.algorithms.filters import overlong_reward_penalty

        penalty = overlong_reward_penalty(batch["response_lengths"], self.cfg.max_response_length,
                                          self.cfg.effective_overlong_buffer(), o.penalty_factor)
        metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
        metrics["reward/overlong_fraction"] = float((penalty < 0).float().mean())
        return scores + penalty

    def advantages(self, batch: dict, scores: torch.Tensor, metrics: dict) -> None:
        """Token rewards (score on the last token, minus a KL penalty if configured) -> the
        configured estimator's advantages and returns, written into ``batch``."""
        from megarl.algorithms import (
            advantage_spec,
            apply_kl_penalty,
            masked_mean,
            rollout_correction_weights,
            rollout_mismatch_metrics,
            scores_to_token_rewards,
        )
        from megarl.config.validate import RUN_ADVANTAGE_INPUTS
        from megarl.workers.batch import response_mask

        alg = self.cfg.algorithm
        mask = response_mask(batch)
        token_rewards = scores_to_token_rewards(scores, mask)
        if alg.kl_penalty.enabled:
            token_rewards, kl = apply_kl_penalty(token_rewards, batch["old_logp"], batch["ref_logp"], mask,
                                                 self.kl_controller.value, alg.kl_penalty.estimator)
            metrics["kl_penalty/kl"] = float(kl["kl"])
            metrics["kl_penalty/coef"] = float(kl["kl_coef"])
            self.kl_controller.update(float(kl["kl"]), n_steps=len(scores))
        # what a run has for the estimator's declared inputs (None: not in this run); config
        # validation refuses an estimator that declares others (megarl.config.validate.RUN_ADVANTAGE_INPUTS)
        supplied = dict(index=batch["uid"], values=batch.get("old_values"), gamma=alg.gamma, lam=alg.lam,
                        norm_by_std=alg.norm_adv_by_std)
        assert tuple(supplied) == RUN_ADVANTAGE_INPUTS, (tuple(supplied), RUN_ADVANTAGE_INPUTS)
        adv, returns = advantage_spec(alg.advantage)(token_rewards=token_rewards, response_mask=mask, **supplied)
        correction = alg.rollout_correction
        if "old_logp" in batch and not correction.bypass:  # the pre-update policy vs the engine's
            mismatch = rollout_mismatch_metrics(batch["old_logp"], batch["rollout_logp"], mask,
                                                correction.low, correction.high)
            metrics.update({f"actor/mismatch/{key}": float(value) for key, value in mismatch.items()})
        if correction.method != "none":
            weights = rollout_correction_weights(correction.method, batch["old_logp"], batch["rollout_logp"], mask,
                                                 correction.low, correction.high)
            adv = adv * weights
            metrics["rollout_correction/weight_mean"] = float(masked_mean(weights, mask))
            metrics["rollout_correction/zeroed_fraction"] = float(masked_mean((weights == 0).float(), mask))
        batch["advantages"], batch["returns"] = adv, returns

    def save_rollouts(self, batch: dict, scores: torch.Tensor, step: int) -> Path:
        """This step's samples as ``rollouts/step_<k>.jsonl``: one line per sample with its prompt
        and response token ids, the response text, its score and advantage at the first token (with
        routing replay its routed experts [positions][layers][top-k]; for multi-turn trajectories
        the loss mask, the tool calls and how it ended)."""
        from parallel.checkpoint.atomic import atomic_file

        target = self.run.out / "rollouts" / f"step_{step:06d}.jsonl"
        lines = []
        for i, text in enumerate(batch["responses"]):
            prompt, response = int(batch["prompt_lengths"][i]), int(batch["response_lengths"][i])
            ids = batch["input_ids"][i].tolist()
            line = {"uid": batch["uid"][i], "prompt_ids": ids[:prompt], "response_ids": ids[prompt:prompt + response],
                    "response": text, "score": float(scores[i]), "advantage": float(batch["advantages"][i, 0])}
            if "routed_experts" in batch:  # routing replay: the experts of every position the engine ran
                line["routed_experts"] = batch["routed_experts"][i, : prompt + response - 1].tolist()
            if "tool_calls" in batch:  # multi-turn: which response tokens the policy wrote, its tool calls
                line.update(loss_mask=batch["loss_mask"][i, :response].int().tolist(),
                            tool_calls=batch["tool_calls"][i], finish=batch["finish"][i])
            lines.append(json.dumps(line))
        with atomic_file(target) as partial:
            partial.write_text("\n".join(lines) + "\n")
        return target
