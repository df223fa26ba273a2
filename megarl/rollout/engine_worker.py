"""A rollout engine as a worker: one SGLang engine (``rollout.tp`` ranks) behind a small API the
controller calls (a Ray actor in a run). It owns the engine handle, so the trainer's resharded
weights go from the Megatron workers to it (a handle of each flat bucket, or its bytes through
Ray's object store), never via the controller.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.rollout.sglang.engine import SGLangEngine
from megarl.rollout.weight_sync import RankShards, sync_weights


class RolloutWorker:
    """Generation with sampling params, in-place weight updates with the parity probe, and the
    colocated release of engine memory that the next update takes back."""

    def __init__(self, model_path: str, tp_size: int, dtype: str, engine_kwargs: dict[str, Any]):
        self._start = lambda: SGLangEngine(model_path, tp_size=tp_size, dtype=dtype, **engine_kwargs)  # noqa: E731
        self.engine = self._start()
        self._stale_prefix_cache = False  # weights changed, cached KV not flushed yet

    def generate(self, prompts: list[list[int]], sampling_params: list[dict], seed: int | None,
                 return_routed_experts: bool = False) -> list[dict]:
        """One dict per prompt: ``output_ids``, ``output_logprobs``, ``finish_reason`` (and
        ``routed_experts``, see ``SGLangEngine.generate``). With ``seed``, sampling is re-seeded
        first so the tokens are a function of (weights, seed)."""
        if seed is not None:
            self.engine.reseed(seed)  # also flushes the prefix cache
        elif self._stale_prefix_cache:
            self.engine.call("flush_cache")
        self._stale_prefix_cache = False
        prefill_shared_prompts(self.engine, prompts)
        return self.engine.generate(prompts, sampling_params, return_logprob=True,
                                    return_routed_experts=return_routed_experts)

    def update_weights(self, *per_rank: RankShards | None) -> dict[str, float]:
        """Copy each engine rank's shards (argument r = rank r, the flat buckets a trainer rank
        made, ``MegatronWorker.rollout_shards``) in place and verify their fingerprints. A sync
        writes every parameter: the engine's own (dummy-loaded at start, or discarded by
        :meth:`release_memory`) are never served. After a release it takes the weights' memory back
        first and the KV cache's and CUDA graphs' after the sync, so the two never need room at once."""
        if any(tensors is None for tensors in per_rank):
            raise ValueError("weight sync: an engine rank received no shards (the plan's destinations "
                             "and the engine's ranks disagree)")
        for rank, (shards, known) in enumerate(zip(per_rank, self.engine.rank_parameter_names())):
            sent = {name for bucket in shards.buckets for name in bucket.layout.names}
            if known - sent:
                raise ValueError(f"weight sync: engine rank {rank} would keep its own values of "
                                 f"{sorted(known - set(sent))[:5]}: a sync writes every parameter")
        released = self.engine.memory_released
        if released:
            self.engine.resume_memory(weights=True)
        self._stale_prefix_cache = True  # flushed by the next generate (cheaply, when it re-seeds)
        stats = sync_weights(self.engine, per_rank, flush_cache=False)
        if released:
            self.engine.resume_memory(weights=False)
        return stats

    def restart(self) -> int:
        """Replace the engine (dead, or to be replaced) by a fresh one with the same arguments; it
        holds the model's initial weights until the next sync. Returns the new engine's pid."""
        self.engine.shutdown()
        self.engine = self._start()
        self._stale_prefix_cache = False
        return self.engine.pid

    def kill_engine(self) -> int:
        """Fault injection (``megarl.faults``): SIGKILL every process of the engine, as a crash
        would; the next request fails with EngineDiedError. Returns the killed pid."""
        import os
        import signal

        os.killpg(self.engine.pid, signal.SIGKILL)
        return self.engine.pid

    def release_memory(self) -> None:
        """Colocated on GPUs, while Megatron trains: the engine gives back its weights, KV cache and
        CUDA graphs (``SGLangEngine.release_memory``); the next :meth:`update_weights` takes them back."""
        self.engine.release_memory()

    def shutdown(self) -> None:
        self.engine.shutdown()


def engine_timeouts(parameters: int, max_new_tokens: int) -> tuple[float, float]:
    """The longest an engine may take to start and to answer one call, in seconds, for a model of
    ``parameters`` (B billion) generating up to ``max_new_tokens`` per call (where
    ``rollout.startup_timeout_s`` / ``rollout.call_timeout_s`` are null; docs/rollout.md):
    start = 600 + 5 B (imports, process groups, KV pool, CUDA-graph capture; weights are not
    read: engines start from dummy weights); call = 300 + max_new_tokens x (0.05 + 0.002 B) + 4 B
    (one decode step per new token, slower for larger models; a weight sync's push and checksums)."""
    billions = parameters / 1e9
    return 600 + 5 * billions, 300 + max_new_tokens * (0.05 + 0.002 * billions) + 4 * billions


def engine_shares(num_samples: int, num_engines: int) -> list[list[int]]:
    """Which samples each engine generates: contiguous, balanced slices (sizes within one). The
    ``rollout.n`` samples of a prompt are consecutive, so they stay on one engine (two where a
    slice ends inside them) and each engine prefills only its own prompts once
    (``prefill_shared_prompts``), where dealing samples round-robin had every engine prefill
    every prompt: ``num_engines`` times the prompt tokens once ``rollout.n >= num_engines``."""
    return [share.tolist() for share in torch.arange(num_samples).tensor_split(num_engines)]


def prefill_shared_prompts(engine: SGLangEngine, prompts: list[list[int]]) -> int:
    """Put every prompt that occurs more than once (``rollout.n`` samples of it) into the engine's
    prefix cache, one prefill of each, so that its samples then prefill only their last token.
    SGLang's scheduler does not share a prefix between requests of one batch: 128 samples of 16
    five-token prompts otherwise prefill 640 tokens instead of 80 + 128. Sampling is untouched (a
    prefill without new tokens draws nothing). Returns the number of prompts prefilled (none when
    the engine runs without a prefix cache)."""
    from collections import Counter

    if engine.engine_kwargs.get("disable_radix_cache"):
        return 0
    counts = Counter(tuple(p) for p in prompts)
    shared = [list(p) for p, count in counts.items() if count > 1 and len(p) > 1]
    if shared:
        engine.generate(shared, {"max_new_tokens": 0})
    return len(shared)
