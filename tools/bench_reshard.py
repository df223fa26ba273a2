"""Benchmark Megatron -> SGLang resharding plans: plan time, bytes moved vs the minimum, and
execution throughput against a plain tensor copy of the same bytes, measured in the same run,
and the weight sync's parity probe: the device fingerprint (``weight_checksum``) of one rank's
buffers against an xxh3-128 hash of their bytes on the host (what the probe used before).

    python tools/bench_reshard.py [--presets bench-llama-100m bench-llama-1b] [--moe-presets bench-qwen3-moe-200m]
                                  [--dtype bfloat16]

Plans are made from the config alone (no tensors). Execution runs every device's copies in this
process (``execute_plan_in_memory``) from preallocated source shards into preallocated
destination buffers, so it measures the copy engine of the plan, not the network; the baseline is
one ``dst.copy_(src)`` over a flat buffer of the same total bytes. A benchmark, not a test: it
prints numbers.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import xxhash

from megarl.rollout.sglang.patches import weight_checksum
from model_specs.base import dtype_from_name
from model_specs.presets import hf_config_dict
from parallel.checkpoint.hf_io import tensor_checksum
from parallel.layout import MegatronLayout
from parallel.reshard.execute import execute_plan_in_memory
from parallel.reshard.plan import megatron_device_positions, plan_megatron_to_sglang
from parallel.shards import megatron_shards

CASES = [  # (name, layout, world size, rollout TP, rollout EP)
    ("TP2 -> TP2 (colocated, equal TP)", MegatronLayout(tp=2), 2, 2, 1),
    ("TP2 -> TP1", MegatronLayout(tp=2), 2, 1, 1),
    ("TP1 -> TP2", MegatronLayout(tp=1), 2, 2, 1),
    ("TP2xPP2 -> TP4", MegatronLayout(tp=2, pp=2), 4, 4, 1),
    ("TP2xPP2 -> TP2", MegatronLayout(tp=2, pp=2), 4, 2, 1),
]
MOE_CASES = [  # Megatron EP -> SGLang's fused experts at TP x EP
    ("EP2 -> TP2xEP2 (same expert split)", MegatronLayout(ep=2), 2, 2, 2),
    ("EP2 -> TP2 (experts split over TP)", MegatronLayout(ep=2), 2, 2, 1),
    ("EP4 -> TP4xEP2", MegatronLayout(ep=4), 4, 4, 2),
    ("TP2xEP2xPP2 -> TP4xEP4", MegatronLayout(tp=2, ep=2, pp=2, sequence_parallel=True), 4, 4, 4),
]
PLAN_ONLY = {  # real shapes, planned from the config alone
    "llama3-70b": [("TP8xPP4 -> TP8", MegatronLayout(tp=8, pp=4), 32, 8, 1),
                   ("TP8xPP4 -> TP4", MegatronLayout(tp=8, pp=4), 32, 4, 1), ("TP8 -> TP8", MegatronLayout(tp=8), 8, 8, 1)],
    "qwen3-30b-a3b": [("EP8 -> TP8xEP8", MegatronLayout(ep=8), 8, 8, 8),
                      ("TP2xEP4 -> TP4xEP4", MegatronLayout(tp=2, ep=4, sequence_parallel=True), 8, 4, 4)],
}


def best_of_both(repeats: int, first, second) -> tuple[float, float]:
    """Best time of each function, run alternately so that load from other processes hits both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, kept in zip((first, second), times):
            start = time.perf_counter()
            fn()
            kept.append(time.perf_counter() - start)
    return min(times[0]), min(times[1])


def run_case(hf: dict, name: str, layout: MegatronLayout, world: int, rollout_tp: int, rollout_ep: int,
             dtype: torch.dtype, repeats: int, execute: bool) -> None:
    element = torch.empty((), dtype=dtype).element_size()
    start = time.perf_counter()
    plan = plan_megatron_to_sglang(hf, layout, world, rollout_tp, element_size=element, rollout_ep=rollout_ep)
    plan_s = time.perf_counter() - start
    start = time.perf_counter()
    plan.check()
    check_s = time.perf_counter() - start
    total = plan.local_bytes + plan.network_bytes
    line = (f"{name:36s} plan {plan_s:6.2f} s  check {check_s:6.2f} s  {total / 2**30:6.2f} GiB  "
            f"network {plan.network_bytes / 2**30:6.2f} GiB (minimum {plan.minimum_network_bytes / 2**30:6.2f})")
    if not execute:
        print(line, flush=True)
        return
    positions = megatron_device_positions(layout, world)
    shards = megatron_shards(hf, layout)
    sources = {device: {(i, key): torch.ones(t.shape, dtype=dtype) for i, chunk in enumerate(shards[pos])
                        for key, t in chunk.items()} for device, pos in positions.items()}
    buffers = {device: {key: torch.zeros(t.shape, dtype=dtype) for key, t in tensors.items()}
               for device, tensors in plan.destinations.items()}
    flat_src = torch.ones(total // element, dtype=dtype)
    flat_dst = torch.zeros_like(flat_src)
    start = time.perf_counter()
    # compiles the plan's runs, kept for every later sync, as are the views of the same tensors
    execute_plan_in_memory(plan, sources, buffers, reuse_views=True)
    first_s = time.perf_counter() - start
    exec_s, copy_s = best_of_both(repeats, lambda: execute_plan_in_memory(plan, sources, buffers, reuse_views=True),
                                  lambda: flat_dst.copy_(flat_src))
    print(f"{line}  first execution {first_s:6.3f} s  execute {exec_s:6.3f} s = {total / exec_s / 1e9:5.2f} GB/s  plain copy "
          f"{total / copy_s / 1e9:5.2f} GB/s  ratio {copy_s / exec_s:5.2f}", flush=True)
    rank = buffers[0]
    nbytes = sum(t.numel() * t.element_size() for t in rank.values())
    fingerprint_s, hash_s = best_of_both(repeats, lambda: [weight_checksum(t) for t in rank.values()],
                                         lambda: [tensor_checksum(t, xxhash.xxh3_128) for t in rank.values()])
    print(f"{'':36s} parity probe of rank 0 ({nbytes / 2**30:5.2f} GiB, {len(rank)} tensors): fingerprint "
          f"{fingerprint_s:6.3f} s = {nbytes / fingerprint_s / 1e9:5.2f} GB/s  xxh3 on the host {hash_s:6.3f} s = "
          f"{nbytes / hash_s / 1e9:5.2f} GB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="*", default=["bench-llama-100m", "bench-llama-1b"])
    parser.add_argument("--moe-presets", nargs="*", default=["bench-qwen3-moe-200m"],
                        help="MoE presets, run through the expert-parallel cases")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plan-only", nargs="*", default=list(PLAN_ONLY), choices=list(PLAN_ONLY),
                        help="presets to plan without executing (too large for this machine's memory)")
    args = parser.parse_args()
    dtype = dtype_from_name(args.dtype)
    print(f"bench_reshard: load average {os.getloadavg()[0]:.2f}, {torch.get_num_threads()} torch threads, "
          f"dtype {args.dtype}", flush=True)
    for presets, cases in ((args.presets, CASES), (args.moe_presets, MOE_CASES)):
        for preset in presets:
            hf = hf_config_dict(preset)
            print(f"\n{preset}", flush=True)
            for case in cases:
                run_case(hf, *case, dtype=dtype, repeats=args.repeats, execute=True)
    for preset in args.plan_only:
        hf = hf_config_dict(preset)
        print(f"\n{preset} (plan only)", flush=True)
        for case in PLAN_ONLY[preset]:
            run_case(hf, *case, dtype=dtype, repeats=args.repeats, execute=False)


if __name__ == "__main__":
    main()
