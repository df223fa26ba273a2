"""Push resharded trainer weights into an SGLang engine and prove the engine now holds them.

The trainer side runs the resharding plan (``parallel.reshard.execute``) into per-SGLang-rank flat
buckets (:class:`RankShards`); ``sync_weights`` delivers them in place (SGLang's "direct" load
inside a weight-update session) and then runs the parity probe: the fingerprint
(``weight_checksum``) of every parameter as each SGLang TP rank holds it, computed on the
engine's device by SGLang's weight checker, must equal the fingerprint the trainer computed on
its device for the buffer it sent. A mismatch fails loudly with the
rank and the parameter. ``logprob_probe`` is the second, end-to-end probe: the engine's log-probs
of a fixed completion against the trainer's.

The trainer's side of a sync: it runs in the process that owns the engine handle, not in SGLang's,
and reaches the engine only through the handle's methods (:mod:`megarl.rollout.sglang.engine`).
``weight_checksum`` is defined next to the patch that makes SGLang's weight checker use it
(:mod:`megarl.rollout.sglang.patches`) and imported here.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Mapping, Sequence

import torch

from megarl.rollout.sglang.engine import SGLangEngine
from megarl.rollout.sglang.patches import weight_checksum
from megarl.rollout.sglang.transport import FlatBucket, FlatLayout, SharedMemoryStaging, flat_payload, flat_views


class WeightSyncError(RuntimeError):
    """The engine does not hold what the trainer sent (names the rank and the parameter)."""


@dataclasses.dataclass
class RankShards:
    """One SGLang rank's tensors as a trainer rank assembled them: flat buckets (each one handle of
    one buffer, :class:`megarl.rollout.sglang.transport.FlatBucket`) and the fingerprint
    (``weight_checksum``) of every tensor, computed where the buffer lives."""

    buckets: list[FlatBucket]
    checksums: dict[str, str]

    @property
    def nbytes(self) -> int:
        return sum(bucket.layout.nbytes for bucket in self.buckets)


def allocate_flats(layouts: Sequence[FlatLayout], device: torch.device,
                   staging: SharedMemoryStaging | None = None) -> list[torch.Tensor]:
    """The trainer's byte buffers for one SGLang rank's buckets, on ``device`` (the actor's
    parameters', where the plan's peer transfers land): on a GPU one fresh buffer per bucket
    (once its IPC handle is exported the producer drops it; torch's CUDA IPC reference count keeps
    the memory from reuse until the engine has loaded and released it, then
    ``torch.cuda.ipc_collect()`` frees it); on CPU views of ``staging``'s shared-memory buffer,
    or, without one or without room in /dev/shm, plain memory."""
    if device.type == "cuda":
        return [torch.empty(layout.nbytes, dtype=torch.uint8, device=device) for layout in layouts]
    flats = staging.flats(0, list(layouts)) if staging is not None else None
    return flats if flats is not None else [torch.empty(layout.nbytes, dtype=torch.uint8) for layout in layouts]


def pack_rank_shards(layouts: Sequence[FlatLayout], flats: Sequence[torch.Tensor], named: bool) -> RankShards:
    """The buckets the plan has written (:func:`allocate_flats`) as they travel, with every
    tensor's fingerprint computed on the buffer's device: with ``named`` (the engine rank shares
    the buffer's device) one handle of each buffer (CUDA IPC, shared memory), else (or when the
    buffer is plain host memory) its bytes, copied to the host."""
    checksums, buckets = {}, []
    for layout, flat in zip(layouts, flats):
        checksums.update({name: weight_checksum(view) for name, view in flat_views(flat, layout).items()})
        buckets.append(FlatBucket(layout, payload=flat_payload(flat, layout)) if named and flat.is_shared()
                       else FlatBucket(layout, data=flat.cpu().numpy()))
    return RankShards(buckets, checksums)


def shard_checksums(per_rank: Sequence[Mapping[str, torch.Tensor]]) -> list[dict[str, str]]:
    """What each SGLang rank must hold after the sync, as SGLang's weight checker (fingerprinting
    with ``weight_checksum``) reports it."""
    return [{name: weight_checksum(tensor) for name, tensor in tensors.items()} for tensors in per_rank]


def check_parity(engine: SGLangEngine, expected: Sequence[Mapping[str, str]] | concurrent.futures.Future) -> None:
    """Raise WeightSyncError unless every expected parameter of every engine rank has the
    expected fingerprint (``expected`` may still be being computed: a Future of it). (That a full
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


def sync_weights(engine: SGLangEngine, per_rank: Sequence[Mapping[str, torch.Tensor]] | Sequence[RankShards],
                 verify: bool = True, bucket_bytes: int = 512 << 20, flush_cache: bool = True) -> dict[str, float]:
    """Copy each engine rank's tensors into its parameters in place, then (by default) run the
    parity probe. ``per_rank[r]`` is rank r's ``{SGLang name: tensor}``, sent in buckets of about
    ``bucket_bytes`` (all ranks together), or a trainer's :class:`RankShards`, sent bucket by
    bucket as the trainer made them, with the fingerprints it computed. Returns timings, bytes
    and bucket count. ``flush_cache=False`` leaves the prefix cache (stale KV) for the caller to
    flush before the next generation (SGLang's flush also garbage-collects the scheduler on CPU)."""
    start = time.perf_counter()
    flat = all(isinstance(rank, RankShards) for rank in per_rank)
    if flat:
        count = max(len(rank.buckets) for rank in per_rank)
        with engine.weight_update():
            for index in range(count):
                engine.update_weights_flat([rank.buckets[index] if index < len(rank.buckets) else None
                                            for rank in per_rank], flush_cache=flush_cache and index == count - 1)
        nbytes = sum(rank.nbytes for rank in per_rank)
    else:
        buckets = _buckets_by_name(per_rank, bucket_bytes)
        count = len(buckets)
        with engine.weight_update():
            for index, names in enumerate(buckets):
                engine.update_weights_direct([{n: tensors[n] for n in names if n in tensors} for tensors in per_rank],
                                             flush_cache=flush_cache and index == count - 1)
        nbytes = sum(t.numel() * t.element_size() for tensors in per_rank for t in tensors.values())
    pushed = time.perf_counter()
    if verify:
        if flat:
            check_parity(engine, [rank.checksums for rank in per_rank])
        else:  # fingerprint the trainer's shards while the schedulers fingerprint theirs (torch frees the GIL)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                check_parity(engine, pool.submit(shard_checksums, per_rank))
    return {"push_s": pushed - start, "verify_s": time.perf_counter() - pushed, "bytes": float(nbytes),
            "buckets": float(count)}


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
