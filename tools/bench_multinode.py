"""Multi-node benchmark: per-phase RL throughput, MFU, weight sync and inter-node collectives.

    # inside an allocation (launch_scripts/bench_multinode.sbatch does this):
    python tools/bench_multinode.py --config configs/quickstart_grpo.yaml --out-dir runs/bench \
        [--steps 3] [--warmup 1] [--size-mb 64] [--iters 10] [--peak-tflops-per-rank X] -- [key=value ...]
    # afterwards, runs of 2, 4, 8 ... nodes side by side, with scaling efficiency:
    python tools/bench_multinode.py --compare runs/bench/bench_multinode_2nodes.json runs/bench/bench_multinode_4nodes.json

One run (N = ``SLURM_JOB_NUM_NODES``) writes ``<out-dir>/bench_multinode_<N>nodes.json`` and the
same as a table in ``.txt``:

* collectives: one task per node (``srun --ntasks-per-node=1``) joins a torch.distributed group
  (gloo on CPU, nccl on GPU; rendezvous on the first node) and times ``all_reduce`` of a
  ``--size-mb`` fp32 buffer and ``all_gather`` of 1/N of it per rank (``--iters`` timed after one
  warm-up). Bandwidths as nccl-tests reports them: algbw = bytes / s; busbw = algbw x 2(N-1)/N
  (all_reduce) or x (N-1)/N (all_gather, bytes = the gathered size) - the per-link rate.
* training: ``megarl train <config> cluster.nodes=N trainer.total_steps=<warmup+steps>
  trainer.output_dir=<out-dir>/train_<N>nodes trainer.resume=none <overrides>`` through
  ``launch_scripts/ray_on_slurm.sh`` (Ray over the allocation), then the medians over the steps
  after ``--warmup`` of the trainer's ``metrics.jsonl``:
  generation tokens/s (``throughput/generated_tokens_per_s``), training tokens/s (the step's
  prompt + response tokens / ``time/update_s``), training TFLOP/s (``perf/train_tflops_per_s``:
  3 x 2 x parameters per token) and MFU = that / (ranks x ``--peak-tflops-per-rank``), weight
  sync seconds (``time/sync_s``) and bytes (``sync/bytes``, also the resharding plan's network /
  local split from ``parallel.reshard.plan.plan_megatron_to_sglang``), every ``time/*`` phase, and the
  whole step's tokens/s.
  The peak per rank defaults to 989 TFLOP/s on a GPU (H100 SXM bf16 dense); on CPU it is measured
  here (an fp32 matmul on the batch host with the threads a rank gets), so CPU MFU is relative.

``--compare`` prints, per run, those numbers and the scaling efficiency of each throughput
relative to the smallest run: (throughput_N / throughput_base) / (N / base).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
H100_BF16_DENSE_TFLOPS = 989.0


# ----------------------------------------------------------------------------- collectives (one task per node)


def collective_worker(size_mb: float, iters: int, out: str) -> None:
    """One rank of the collective benchmark (launched by srun; env:// rendezvous)."""
    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available()
    backend = "nccl" if gpu else "gloo"
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    numel = max(world, int(size_mb * 2**20) // 4 // world * world)
    full = torch.ones(numel, dtype=torch.float32, device=device)
    part = torch.full((numel // world,), float(rank), dtype=torch.float32, device=device)
    parts = [torch.empty_like(part) for _ in range(world)]

    def timed(op) -> float:
        op()  # warm-up (connection setup)
        if gpu:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            op()
        if gpu:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / iters

    dist.all_reduce(full)
    if float(full[0]) != world or float(full[-1]) != world:
        raise RuntimeError(f"all_reduce of ones gave {float(full[0])}, expected {world}")
    reduce_s = timed(lambda: dist.all_reduce(full))
    gather_s = timed(lambda: dist.all_gather(parts, part))
    if [float(p[0]) for p in parts] != [float(r) for r in range(world)]:
        raise RuntimeError("all_gather returned the wrong chunks")
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    if rank == 0:
        nbytes = numel * 4

        def entry(seconds: float, factor: float) -> dict:
            algbw = nbytes / seconds / 1e9
            return {"bytes": nbytes, "seconds": seconds, "algbw_GBps": algbw, "busbw_GBps": algbw * factor}

        result = {"backend": backend, "world": world, "hosts": hosts, "iters": iters,
                  "all_reduce": entry(reduce_s, 2 * (world - 1) / world),
                  "all_gather": entry(gather_s, (world - 1) / world)}
        Path(out).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


def run_collectives(nodes: int, args: argparse.Namespace, out: Path) -> dict:
    """srun one task per node running ``collective_worker``; returns rank 0's JSON."""
    first = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()[0]
    try:
        master = socket.gethostbyname(first)
    except OSError:
        master = first
    env = dict(os.environ, MASTER_ADDR=master, MASTER_PORT=str(args.port or 20000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
    if os.environ.get("MEGARL_NET_IFACE"):
        env.update(GLOO_SOCKET_IFNAME=os.environ["MEGARL_NET_IFACE"], NCCL_SOCKET_IFNAME=os.environ["MEGARL_NET_IFACE"])
    inner = ("export WORLD_SIZE=$SLURM_NTASKS RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID; exec "
             + shlex.join([sys.executable, str(Path(__file__).resolve()), "--collective-worker", "--size-mb",
                           str(args.size_mb), "--iters", str(args.iters), "--collective-out", str(out)]))
    cmd = ["srun", "--overlap", f"--nodes={nodes}", "--ntasks-per-node=1", f"--ntasks={nodes}",
           "--kill-on-bad-exit=1", "bash", "-c", inner]
    print(f"bench_multinode: collectives: {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, env=env, check=True, timeout=args.timeout)
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------- the trainer's phases


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def summarize_metrics(rows: list[dict], warmup: int, ranks: int, peak_tflops_per_rank: float) -> dict:
    """Per-phase medians over the steps after ``warmup`` of a metrics.jsonl."""
    timed = [dict(r) for r in (rows[warmup:] if len(rows) > warmup else rows[-1:])]
    summary: dict = {"steps": [int(r["step"]) for r in timed]}
    for row in timed:
        if "time/update_s" in row and "throughput/tokens_per_s" in row:
            row["_train_tokens_per_s"] = row["throughput/tokens_per_s"] * row["time/step_s"] / row["time/update_s"]
        if "sync/bytes" in row and row.get("time/sync_s"):
            row["_sync_bytes_per_s"] = row["sync/bytes"] / row["time/sync_s"]
    names = {
        "generation_tokens_per_s": "throughput/generated_tokens_per_s",
        "training_tokens_per_s": "_train_tokens_per_s",
        "step_tokens_per_s": "throughput/tokens_per_s",
        "train_tflops_per_s": "perf/train_tflops_per_s",
        "sync_seconds": "time/sync_s",
        "sync_bytes": "sync/bytes",
        "sync_bytes_per_s": "_sync_bytes_per_s",
        "step_seconds": "time/step_s",
    }
    for out, key in names.items():
        summary[out] = _median(timed, key)
    summary["phase_seconds"] = {k[len("time/"):-len("_s")]: _median(timed, k)
                                for k in sorted({k for r in timed for k in r if k.startswith("time/")} - {"time/step_s"})}
    tflops = summary["train_tflops_per_s"]
    summary["mfu"] = tflops / (ranks * peak_tflops_per_rank) if tflops is not None else None
    return summary


def sync_plan_bytes(config) -> dict:
    """The resharding plans' bytes per sync (what ``sync/bytes`` should be, and its network part)."""
    from megarl.config.validate import model_hf_config
    from megarl.controller.rollout_manager import weight_sync_rounds

    plans = [plan for _, plan in weight_sync_rounds(config, model_hf_config(config.model.path))]
    return {"network_bytes": sum(p.network_bytes for p in plans), "local_bytes": sum(p.local_bytes for p in plans),
            "minimum_network_bytes": sum(p.minimum_network_bytes for p in plans)}


def measured_cpu_peak_tflops(threads: int) -> float:
    """fp32 matmul TFLOP/s on this host with ``threads`` threads (the CPU 'peak' for MFU)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(4):
                a @ b
            best = min(best, (time.perf_counter() - start) / 4)
        return 2 * n**3 / best / 1e12
    finally:
        torch.set_num_threads(previous)


def run_training(nodes: int, args: argparse.Namespace, out_dir: Path) -> tuple[Path, list[dict], list[str]]:
    train_dir = out_dir / f"train_{nodes}nodes"
    overrides = [f"cluster.nodes={nodes}", f"trainer.total_steps={args.warmup + args.steps}",
                 f"trainer.output_dir={train_dir}", "trainer.resume=none", "trainer.save_every=0", *args.overrides]
    cmd = ["bash", str(ROOT / "launch_scripts/ray_on_slurm.sh"), "megarl", "train", "--no-export", args.config, *overrides]
    print(f"bench_multinode: training: {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, timeout=args.timeout, cwd=ROOT)
    metrics = train_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not rows:
        raise RuntimeError(f"{metrics} has no steps")
    return train_dir, rows, overrides


# ----------------------------------------------------------------------------- report


def _fmt(value, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{value * scale:.{digits}g}"


def table(result: dict) -> str:
    t, c = result.get("training") or {}, result.get("collectives") or {}
    lines = [f"bench_multinode: {result['nodes']} nodes x {result.get('ranks_per_node', '?')} ranks "
             f"({result.get('device', '?')}), job {result.get('job_id', '-')}, {result.get('finished', '')}",
             f"{'metric':34s} value"]

    def row(name: str, value: str) -> None:
        lines.append(f"{name:34s} {value}")

    if t:
        row("generation tokens/s", _fmt(t["generation_tokens_per_s"]))
        row("training tokens/s", _fmt(t["training_tokens_per_s"]))
        row("step tokens/s (whole RL step)", _fmt(t["step_tokens_per_s"]))
        row("training TFLOP/s (all ranks)", _fmt(t["train_tflops_per_s"]))
        row(f"MFU (peak {result['peak_tflops_per_rank']:.3g} TFLOP/s/rank)", _fmt(t["mfu"], 100) + " %")
        row("weight sync s", _fmt(t["sync_seconds"]))
        row("weight sync MiB", _fmt(t["sync_bytes"], 1 / 2**20))
        if result.get("sync_plan"):
            p = result["sync_plan"]
            row("  plan: network / local MiB", f"{p['network_bytes'] / 2**20:.3g} / {p['local_bytes'] / 2**20:.3g}")
        row("step s", _fmt(t["step_seconds"]))
        for phase, seconds in t["phase_seconds"].items():
            row(f"  {phase} s", _fmt(seconds))
    for op in ("all_reduce", "all_gather"):
        if op in c:
            e = c[op]
            row(f"{op} {e['bytes'] / 2**20:.0f} MiB ({c['backend']})",
                f"{e['seconds'] * 1e3:.3g} ms, algbw {e['algbw_GBps']:.3g} GB/s, busbw {e['busbw_GBps']:.3g} GB/s")
    return "\n".join(lines)


COMPARED = (("generation tokens/s", ("training", "generation_tokens_per_s")),
            ("training tokens/s", ("training", "training_tokens_per_s")),
            ("step tokens/s", ("training", "step_tokens_per_s")),
            ("MFU %", ("training", "mfu")),
            ("sync s", ("training", "sync_seconds")),
            ("all_reduce busbw GB/s", ("collectives", "all_reduce", "busbw_GBps")),
            ("all_gather busbw GB/s", ("collectives", "all_gather", "busbw_GBps")))
SCALED = ("generation tokens/s", "training tokens/s", "step tokens/s")


def _get(result: dict, path: tuple) -> float | None:
    value = result
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def compare(paths: list[str]) -> str:
    results = sorted((json.loads(Path(p).read_text()) for p in paths), key=lambda r: r["nodes"])
    base = results[0]
    header = f"{'metric':26s}" + "".join(f"{str(r['nodes']) + ' nodes':>14s}" for r in results)
    lines = [header]
    for name, path in COMPARED:
        scale = 100 if name == "MFU %" else 1
        lines.append(f"{name:26s}" + "".join(f"{_fmt(_get(r, path), scale):>14s}" for r in results))
    for name, path in COMPARED:
        if name not in SCALED:
            continue
        cells = []
        for r in results:
            b, v = _get(base, path), _get(r, path)
            eff = (v / b) / (r["nodes"] / base["nodes"]) if b and v else None
            cells.append("-" if eff is None else f"{100 * eff:.0f} %")
        lines.append(f"{'scaling eff. ' + name.split()[0]:26s}" + "".join(f"{c:>14s}" for c in cells))
    lines.append(f"(scaling efficiency = (throughput_N / throughput_{base['nodes']}) / (N / {base['nodes']}))")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> int:
    from megarl.config import ConfigError, load_config

    if "SLURM_JOB_ID" not in os.environ:
        print("bench_multinode: run it inside a Slurm allocation (sbatch launch_scripts/bench_multinode.sbatch)",
              file=sys.stderr)
        return 2
    nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:  # validated (with cluster.nodes = the allocation) before any srun
        config = load_config(args.config, [f"cluster.nodes={nodes}", *args.overrides], check_files=not args.skip_train)
    except ConfigError as error:
        for line in error.problems:
            print(f"bench_multinode: config error: {line}", file=sys.stderr)
        return 2
    c = config.cluster
    ranks = c.world_size
    if args.peak_tflops_per_rank:
        peak, source = args.peak_tflops_per_rank, "--peak-tflops-per-rank"
    elif c.device == "gpu":
        peak, source = H100_BF16_DENSE_TFLOPS, "H100 SXM bf16 dense (default)"
    else:
        threads = max(1, (os.cpu_count() or 1) // c.ranks_per_node)
        peak, source = measured_cpu_peak_tflops(threads), f"measured fp32 matmul, {threads} thread(s), batch host"
    result: dict = {"nodes": nodes, "ranks_per_node": c.ranks_per_node, "ranks": ranks, "device": c.device,
                    "job_id": os.environ["SLURM_JOB_ID"], "config": args.config, "overrides": args.overrides,
                    "peak_tflops_per_rank": peak, "peak_source": source,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if not args.skip_collectives:
        result["collectives"] = run_collectives(nodes, args, out_dir / f"collectives_{nodes}nodes.json")
    if not args.skip_train:
        train_dir, rows, overrides = run_training(nodes, args, out_dir)
        result["train_command_overrides"] = overrides
        result["train_dir"] = str(train_dir)
        result["training"] = summarize_metrics(rows, args.warmup, ranks, peak)
        result["sync_plan"] = sync_plan_bytes(config)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    stem = out_dir / f"bench_multinode_{nodes}nodes"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = table(result)
    stem.with_suffix(".txt").write_text(text + "\n")
    print(text)
    print(f"bench_multinode: wrote {stem}.json and {stem}.txt")
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                     epilog="Arguments after -- (or unrecognised key=value ones) are config overrides.")
    parser.add_argument("--config", default="configs/quickstart_grpo.yaml")
    parser.add_argument("--out-dir", default="runs/bench_multinode")
    parser.add_argument("--steps", type=int, default=3, help="timed RL steps")
    parser.add_argument("--warmup", type=int, default=1, help="RL steps run first and left out of the medians")
    parser.add_argument("--size-mb", type=float, default=64.0, help="collective buffer size")
    parser.add_argument("--iters", type=int, default=10, help="timed collective iterations")
    parser.add_argument("--port", type=int, default=None, help="collective rendezvous port (default from the job id)")
    parser.add_argument("--peak-tflops-per-rank", type=float, default=None)
    parser.add_argument("--skip-collectives", action="store_true")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per phase")
    parser.add_argument("--compare", nargs="+", metavar="JSON", help="print runs side by side and exit")
    parser.add_argument("--collective-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--collective-out", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="config overrides key=value")
    args, extra = parser.parse_known_args(argv)
    if any(not e.count("=") or e.startswith("-") for e in extra):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = [*args.overrides, *extra]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.collective_worker:
        collective_worker(args.size_mb, args.iters, args.collective_out)
        return 0
    if args.compare:
        print(compare(args.compare))
        return 0
    sys.path.insert(0, str(ROOT))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
