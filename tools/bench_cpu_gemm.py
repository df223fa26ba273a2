#!/usr/bin/env python
"""fp32 CPU GEMM throughput: ATen's default (MKL SGEMM, what ``F.linear`` uses) against oneDNN
(:func:`parallel.cpu.linear.linear`), the two backends megarl's CPU workers and engines choose
between (``MEGARL_CPU_LINEAR``, by default the faster one on this machine), on a Qwen2-shaped
model's linear layers: forward, input gradient and weight gradient at a decode-sized and a
training-sized token count. Prints GFLOP/s per shape, the time-weighted total, and what the
automatic choice picked here.

    python tools/bench_cpu_gemm.py [--hidden 512 --ffn 1664 --heads 8 --kv-heads 4 --vocab 4096]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from parallel.cpu import linear as cpu_linear  # noqa: E402


def seconds_per_call(fn, min_s: float) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1664)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 2048],
                        help="rows per GEMM (a decode step's batch, a training micro-batch)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-seconds", type=float, default=0.3, help="timing per measurement")
    args = parser.parse_args(argv)
    for name in ("hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    os.environ[cpu_linear.ENV_VAR] = "onednn"  # this tool times both, whatever the processes choose
    cpu_linear.backend.cache_clear()
    if cpu_linear.backend() != "onednn":
        print("no oneDNN in this torch build: nothing to compare")
        return 1
    qkv = (args.heads + 2 * args.kv_heads) * args.head_dim
    layers = {"qkv": (args.hidden, qkv), "o": (args.heads * args.head_dim, args.hidden),
              "gate_up": (args.hidden, 2 * args.ffn), "down": (args.ffn, args.hidden),
              "lm_head": (args.hidden, args.vocab)}
    print(f"{torch.get_num_threads()} threads; GFLOP/s, ATen (MKL) vs oneDNN")
    print(f"{'tokens':>6} {'layer':>8} {'gemm':>6} {'aten':>7} {'onednn':>7} {'ratio':>6}")
    totals = {"aten": 0.0, "onednn": 0.0}
    for tokens in args.tokens:
        for layer, (k, n) in layers.items():
            x, w, g = torch.randn(tokens, k), torch.randn(n, k), torch.randn(tokens, n)
            gemms = {"fwd": (x, w), "dgrad": (g, w.t()), "wgrad": (g.t(), x.t())}
            for gemm, (a, b) in gemms.items():
                flops = 2 * a.shape[0] * a.shape[1] * b.shape[0]
                aten = seconds_per_call(lambda: F.linear(a, b), args.min_seconds)
                onednn = seconds_per_call(lambda: cpu_linear.linear(a, b), args.min_seconds)
                totals["aten"] += aten
                totals["onednn"] += onednn
                print(f"{tokens:>6} {layer:>8} {gemm:>6} {flops / aten / 1e9:7.1f} "
                      f"{flops / onednn / 1e9:7.1f} {aten / onednn:6.2f}x")
    print(f"all shapes, one call each: aten {totals['aten'] * 1e3:.1f} ms, onednn "
          f"{totals['onednn'] * 1e3:.1f} ms ({totals['aten'] / totals['onednn']:.2f}x)")
    print(f"{cpu_linear.ENV_VAR}=auto takes {cpu_linear.measured_backend()} on this machine "
          f"({cpu_linear.machine_key()}; kept in {cpu_linear.cache_dir() / cpu_linear.CACHE_FILE})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
