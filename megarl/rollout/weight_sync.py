"""Push resharded trainer weights into an SGLang engine and prove the engine now holds them.

The trainer side runs the resharding plan (``parallel.reshard.execute``) into per-SGLang-rank buffers;
``sync_weights`` delivers them in place (SGLang's "direct" load inside a weight-update session)
and then runs the parity probe: the checksum (``weight_checksum``) of every parameter as each
SGLang TP rank holds it, computed inside the engine's schedulers by SGLang's weight checker, must
equal the checksum of the buffer the trainer computed for it. A mismatch fails loudly with the
rank and the parameter. ``logprob_probe`` is the second, end-to-end probe: the engine's log-probs
of a fixed completion against the trainer's.

The trainer's side of a sync: it runs in the process that owns the engine handle, not in SGLang's,
and reaches the engine only through the handle's methods (:mod:`megarl.rollout.sglang.engine`).
``weight_checksum`` is defined next to the patch that makes SGLang's weight checker use it
(:mod:`megarl.rollout.sglang.patches`) and imported here.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Mapping, Sequence

import torch

from megarl.rollout.sglang.engine import SGLangEngine
from megarl.rollout.sglang.patches import weight_checksum


class WeightSyncError(RuntimeError):
    """The engine does not hold what the trainer sent (names the rank and the parameter)."""


def shard_checksums(per_rank: Sequence[Mapping[str, torch.Tensor]]) -> list[dict[str, str]]:
    """What each SGLang rank must hold after the sync, as SGLang's weight checker (hashing with
    ``weight_checksum``) reports it."""
    return [{name: weight_checksum(tensor) for name, tensor in tensors.items()} for tensors in per_rank]


def shards_for_transport(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple]:
    """``{name: tensor}`` as ``{name: (bytes as a numpy array, dtype name, shape)}`` for a Ray hop:
    Ray hands numpy arrays to the reader straight from its object store, while torch tensors are
    pickled on both sides (88 MB: 0.14 s against 1.0 s here). Any dtype (bfloat16 has no numpy type)."""
    return {name: (t.detach().contiguous().reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."),
                   tuple(t.shape)) for name, t in tensors.items()}


def shards_from_transport(packed: Mapping[str, tuple]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`shards_for_transport` (read-only views of the received arrays)."""
    import warnings

    with warnings.catch_warnings():  # Ray's arrays are read-only; these tensors are only read
        warnings.simplefilter("ignore", UserWarning)
        return {name: torch.from_numpy(data).view(getattr(torch, dtype)).view(shape)
                for name, (data, dtype, shape) in packed.items()}


def check_parity(engine: SGLangEngine, expected: Sequence[Mapping[str, str]] | concurrent.futures.Future) -> None:
    """Raise WeightSyncError unless every expected parameter of every engine rank has the
    expected checksum (``expected`` may still be being computed: a Future of it). (That a full
    sync names every SGLang parameter is the plan's guarantee, tested against SGLang's own loaders.)"""
    actual = engine.rank_parameter_checksums()
    if isinstance(expected, concurrent.futures.Future):
        expected = expected.result()
    for rank, (want, have) in enumerate(zip(expected, actual)):
        for name, digest in want.items():
            if have.get(name) != digest:
                raise WeightSyncError(
                    f"SGLang TP rank {rank} holds {name} with checksum {have.get(name)}, the trainer's "
                    f"shard has {digest}: the weight sync corrupted or missed it"
                )


def sync_weights(engine: SGLangEngine, per_rank: Sequence[Mapping[str, torch.Tensor]],
                 verify: bool = True, bucket_bytes: int = 512 << 20, flush_cache: bool = True) -> dict[str, float]:
    """Copy ``per_rank[r]`` (SGLang names -> rank r's tensors) into the engine in place, in
    buckets of about ``bucket_bytes`` (all ranks together; the engine decodes one bucket at a
    time), then (by default) run the parity probe. Returns timings, bytes and bucket count.
    ``flush_cache=False`` leaves the prefix cache (stale KV) for the caller to flush before the
    next generation (SGLang's flush also garbage-collects the scheduler on CPU: ~0.3 s)."""
    start = time.perf_counter()
    buckets = _buckets_by_name(per_rank, bucket_bytes)
    with engine.weight_update():
        for index, names in enumerate(buckets):
            engine.update_weights_direct([{n: tensors[n] for n in names if n in tensors} for tensors in per_rank],
                                         flush_cache=flush_cache and index == len(buckets) - 1)
    pushed = time.perf_counter()
    if verify:
        # xxhash releases the GIL: hash the trainer's shards while the schedulers hash theirs
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            expected = pool.submit(shard_checksums, per_rank)
            check_parity(engine, expected)
    return {
        "push_s": pushed - start,
        "verify_s": time.perf_counter() - pushed,
        "bytes": float(sum(t.numel() * t.element_size() for tensors in per_rank for t in tensors.values())),
        "buckets": float(len(buckets)),
    }


def _buckets_by_name(per_rank: Sequence[Mapping[str, torch.Tensor]], bucket_bytes: int) -> list[list[str]]:
    """Parameter names in order, grouped so each group's bytes over all ranks stay near the bound
    (a single larger tensor gets a bucket of its own)."""
    names = list(dict.fromkeys(name for tensors in per_rank for name in tensors))
    buckets, current, size = [], [], 0
    for name in names:
        nbytes = sum(t[name].numel() * t[name].element_size() for t in per_rank if name in t)
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def logprob_probe(engine: SGLangEngine, prompt: list[int], completion: list[int],
                  reference: torch.Tensor, atol: float) -> float:
    """Max |engine - reference| log-prob of ``completion`` after ``prompt`` (greedy re-generation
    must reproduce ``completion``); raises WeightSyncError above ``atol``."""
    out = engine.generate([prompt], {"temperature": 0.0, "max_new_tokens": len(completion), "ignore_eos": True},
                          return_logprob=True)[0]
    if out["output_ids"] != completion:
        raise WeightSyncError(f"log-prob probe: engine generated {out['output_ids']}, trainer expects {completion}")
    diff = float((torch.tensor(out["output_logprobs"]) - reference.float()).abs().max())
    if diff > atol:
        raise WeightSyncError(f"log-prob probe: max |engine - trainer| = {diff:.3g} > {atol}")
    return diff
