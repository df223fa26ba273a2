"""What a step reports beside the losses: phase times (``time/<phase>_s``, also drawn on the
timeline), rewards and lengths, the weight-version lag of the samples, throughput and the
training TFLOP/s (from ``model_specs.arithmetic``: active parameters for MoE)."""

from __future__ import annotations

import time

import torch

from megarl.metrics import Timeline


class PhaseTimer:
    """``with timed(phase):`` records the phase's duration as ``time/<phase>_s`` in ``metrics`` and
    its span on the controller's lane of the timeline, labelled with (1-based) ``step``."""

    def __init__(self, metrics: dict, timeline: Timeline, step: int):
        self.metrics, self.timeline, self.step = metrics, timeline, step

    def __call__(self, phase: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.start = time.time()

            def __exit__(self, *exc):
                end = time.time()
                timer.metrics[f"time/{phase}_s"] = end - self.start
                timer.timeline.span(phase, "controller", self.start, end, timer.step)

        return _Phase()


def rl_step_metrics(batch: dict, scores: torch.Tensor, reward_stats: dict, trained_version: int,
                    elapsed_s: float) -> dict[str, float]:
    """A finished RL step's metrics: rewards and response lengths, the rollout's own metrics, the
    lag of each sample's weights behind ``trained_version`` (the updates the trained weights had)
    and throughput over ``elapsed_s``."""
    metrics = {**batch["rollout_metrics"]}
    lengths = batch["response_lengths"].float()
    metrics.update({
        "reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
    })
    metrics.update({f"reward/{k}": float(v) for k, v in reward_stats.items() if isinstance(v, (int, float))})
    lag = trained_version - batch["weight_version"]  # updates between the generating weights and the trained ones
    metrics.update({"rollout/version_lag_mean": float(lag.float().mean()), "rollout/version_lag_max": float(lag.max())})
    metrics.update({f"rollout/version_lag/{int(v)}": float((lag == v).sum()) for v in lag.unique()})
    tokens = batch_tokens(batch)
    metrics.update({"time/step_s": elapsed_s, "throughput/samples_per_s": len(scores) / elapsed_s,
                    "throughput/tokens_per_s": tokens / elapsed_s,
                    "throughput/generated_tokens_per_s": float(batch["response_lengths"].sum())
                    / metrics["time/generation_s"]})
    return metrics


def batch_tokens(batch: dict) -> float:
    """Prompt and response tokens of a batch's rows."""
    return float((batch["prompt_lengths"] + batch["response_lengths"]).sum())


def train_tflops_per_s(hf_config: dict, batch: dict, update_s: float) -> float:
    """Training TFLOP/s of an update on ``batch``: forward and backward, 3x the forward FLOPs of its
    rows (the matmuls of the parameters each token activates, and causal attention)."""
    from model_specs.arithmetic import forward_flops

    lengths = (batch["prompt_lengths"] + batch["response_lengths"]).tolist()
    return 3 * forward_flops(hf_config, lengths) / update_s / 1e12
