"""Benchmark HF <-> Megatron conversion: megarl vs a plain file copy vs mbridge. Prints a table.

    python tools/bench_convert.py [--preset bench-llama-100m] [--tp 1,2] [--repeats 2] [--workdir DIR]

One run builds the preset as an HF safetensors checkpoint in a temporary directory under
--workdir (removed at the end, also on failure) and measures, taking the minimum over repeats:

1. file copy: ``shutil.copyfile`` of the checkpoint's safetensors files to the same disk (no
   fsync, as for the conversions), page cache warmed by reading the source first.
2. megarl convert, the CLI path (``run_on_ranks(conversion_on_rank, ...)`` as ``megarl convert``
   runs it), HF -> Megatron and Megatron -> HF, with verification and with ``--no-verify``.
   ``wall s`` includes spawning the ranks and their imports; ``rank s`` is the job itself (the
   report's ``seconds``: open + validate the checkpoint, process groups, meta model, checksums of
   the source, the streamed write [, read back + logit probe, which builds the model]).
   GB/s = HF checkpoint bytes / rank s; ``x copy`` = that throughput / the copy's.
   Peak RSS is the largest rank's (``ru_maxrss``) when the conversion is done (``conv``) and at
   the end (``all``: with verification, the logit probe builds the model and HF transformers'),
   also as a multiple of the checkpoint's bytes.
3. megarl vs mbridge (``mbridge==0.15.1``, requirements/dev.txt) doing the same work in the same
   ranks, threads and layout, on Megatron chunks both already built (building excluded):
   ``load``: HF safetensors -> the chunks' parameters (megarl: open + validate the checkpoint,
   ``load_hf_into_chunks``; mbridge: create the bridge, ``load_weights``);
   ``export``: the chunks -> an HF safetensors checkpoint on disk (megarl: ``gather_hf_tensors``
   into ``write_hf_checkpoint``; mbridge: ``save_weights``). Imports are excluded from both; the
   page cache is warmed before every load; the two alternate which goes first. The loaded weights
   are checked to be identical. mbridge runs on megatron's local spec through the overrides in
   tests/parallel/checkpoint/mbridge_oracle.py.

Every rank runs with the same OMP_NUM_THREADS (cores // ranks, as ``run_on_ranks`` does).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def files_of(path: Path) -> list[Path]:
    return sorted(p for p in Path(path).rglob("*") if p.is_file())


def warm(path: Path) -> int:
    """Read every file under ``path`` (into the page cache); returns the bytes read."""
    total = 0
    for file in files_of(path):
        with open(file, "rb") as handle:
            while chunk := handle.read(64 << 20):
                total += len(chunk)
    return total


def threads_env(world: int) -> dict[str, str]:
    from parallel.spawn import threads_per_rank

    return {"OMP_NUM_THREADS": str(threads_per_rank(world))}


# ------------------------------------------------------------------------ rank functions


def in_memory_rank(hf_dir: str, out_base: str, layout_kwargs: dict, repeats: int) -> dict:
    """megarl vs mbridge: load into built chunks, export to HF files. Times on rank 0."""
    import warnings

    import torch
    import torch.distributed as dist

    from parallel.checkpoint.convert import export_hf_checkpoint, load_hf_into_chunks
    from parallel.checkpoint.hf_io import HFCheckpoint
    from parallel.layout import MegatronLayout
    from parallel.models import build_model_chunks
    from parallel.process_groups import initialize_megatron
    from tests.parallel.checkpoint.mbridge_oracle import local_spec_bridge

    warnings.filterwarnings("ignore", message="No index file found")
    layout = MegatronLayout(**layout_kwargs)
    initialize_megatron(layout)
    config = HFCheckpoint(hf_dir).config
    local_spec_bridge(hf_dir, layout)  # untimed: mbridge's and transformers' imports happen here
    ours, theirs = build_model_chunks(config, layout), build_model_chunks(config, layout)
    rank0 = dist.get_rank() == 0
    times: dict[str, list[float]] = {"megarl load": [], "mbridge load": [], "megarl export": [], "mbridge export": []}
    state = {}

    def timed(key, work):
        if rank0 and key.endswith("load"):
            warm(Path(hf_dir))
        dist.barrier()
        start = time.perf_counter()
        work()
        dist.barrier()
        times[key].append(time.perf_counter() - start)

    def megarl_load():
        load_hf_into_chunks(ours, HFCheckpoint(hf_dir), layout)

    def mbridge_load():
        state["bridge"] = local_spec_bridge(hf_dir, layout)
        with torch.no_grad():
            state["bridge"].load_weights(theirs, hf_dir)

    def megarl_export(target):
        export_hf_checkpoint(ours, config, layout, target)

    identical = True
    for repeat in range(repeats):
        loads = [("megarl load", megarl_load), ("mbridge load", mbridge_load)]
        exports = [("megarl export", lambda: megarl_export(f"{out_base}/megarl-{repeat}")),
                   ("mbridge export", lambda: state["bridge"].save_weights(theirs, f"{out_base}/mbridge-{repeat}"))]
        if repeat % 2:
            loads.reverse()
            exports.reverse()
        for key, work in loads:
            timed(key, work)
        if repeat == 0:
            for a, b in zip(ours, theirs):
                for (_, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
                    identical &= torch.equal(x, y)
        for key, work in exports:
            timed(key, work)
        dist.barrier()
        if rank0:
            for name in (f"megarl-{repeat}", f"mbridge-{repeat}"):
                shutil.rmtree(f"{out_base}/{name}", ignore_errors=True)
    flag = torch.tensor([1.0 if identical else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return {"times": times, "identical": bool(flag.item())}


# ------------------------------------------------------------------------ measurements


def bench_copy(hf_dir: Path, work: Path, repeats: int) -> float:
    sources = [f for f in files_of(hf_dir) if f.suffix == ".safetensors"]
    best = float("inf")
    for _ in range(repeats):
        warm(hf_dir)
        target = work / "copy"
        target.mkdir()
        start = time.perf_counter()
        for file in sources:
            shutil.copyfile(file, target / file.name)
        best = min(best, time.perf_counter() - start)
        shutil.rmtree(target)
    return best


def bench_cli(direction: str, source: Path, target: Path, tp: int, verify: bool, repeats: int) -> dict:
    """``megarl convert`` as the CLI runs it; the last repeat's output is kept at ``target``."""
    from parallel.checkpoint.convert import conversion_on_rank
    from parallel.layout import MegatronLayout
    from parallel.spawn import run_on_ranks

    best = None
    for repeat in range(repeats):
        if target.exists():
            shutil.rmtree(target)
        warm(source)
        start = time.perf_counter()
        report = run_on_ranks(conversion_on_rank, tp, direction, str(source), str(target), MegatronLayout(tp=tp),
                              verify, timeout_s=1800, env=threads_env(tp))[0]
        report["wall"] = time.perf_counter() - start
        log(f"  {direction} tp={tp} verify={verify} run {repeat + 1}/{repeats}: wall {report['wall']:.1f} s, "
            f"rank {report['seconds']:.1f} s")
        if best is None or report["seconds"] < best["seconds"]:
            best = report
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="bench-llama-100m", help="model preset (model_specs/presets.py)")
    parser.add_argument("--tp", default="1,2", help="comma-separated TP sizes (one rank per TP rank)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per measurement; the minimum is reported")
    parser.add_argument("--workdir", default=tempfile.gettempdir(), help="where the temporary checkpoints go")
    parser.add_argument("--skip-mbridge", action="store_true", help="measure megarl and the file copy only")
    args = parser.parse_args(argv)
    tps = [int(t) for t in args.tp.split(",")]
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    from model_specs.presets import PRESETS, hf_config_dict, save_tiny_hf_model

    if args.preset not in PRESETS:
        parser.error(f"--preset {args.preset!r} does not exist; choose one of {sorted(PRESETS)}")
    from parallel.layout import MegatronLayout

    for tp in tps:
        MegatronLayout(tp=tp).validate(tp, hf_config_dict(args.preset))
    if not args.skip_mbridge:
        import importlib.util

        if importlib.util.find_spec("mbridge") is None:
            parser.error("mbridge is not installed (pip install -r requirements/dev.txt), or pass --skip-mbridge")

    load_before = os.getloadavg()
    log(f"load average (1/5/15 min) {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} on "
        f"{os.cpu_count()} cores; OMP_NUM_THREADS per rank: "
        + ", ".join(f"TP={tp}: {threads_env(tp)['OMP_NUM_THREADS']}" for tp in tps))
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="megarl-bench-", dir=args.workdir))
    try:
        hf_dir = work / "hf"
        log(f"building {args.preset} as an HF checkpoint in {hf_dir}")
        save_tiny_hf_model(args.preset, hf_dir, seed=0)
        ckpt_bytes = sum(f.stat().st_size for f in files_of(hf_dir) if f.suffix == ".safetensors")
        import math

        from parallel.shards import hf_tensor_shapes

        params = sum(math.prod(s) for s in hf_tensor_shapes(hf_config_dict(args.preset)).values())
        log(f"{params / 1e6:.1f}M parameters, {ckpt_bytes / 1e6:.1f} MB of safetensors")

        log(f"file copy x{max(3, args.repeats)}")
        copy_s = bench_copy(hf_dir, work, max(3, args.repeats))
        copy_gbps = ckpt_bytes / copy_s / 1e9
        log(f"  copy: {copy_s:.3f} s, {copy_gbps:.2f} GB/s")

        cli_rows, mem_rows = [], []
        for tp in tps:
            mcore = work / f"mcore-tp{tp}"
            for verify in (True, False):
                row = bench_cli("hf-to-megatron", hf_dir, mcore, tp, verify, args.repeats)
                cli_rows.append(("hf-to-megatron", tp, verify, row))
            for verify in (True, False):
                row = bench_cli("megatron-to-hf", mcore, work / f"export-tp{tp}", tp, verify, args.repeats)
                cli_rows.append(("megatron-to-hf", tp, verify, row))
            shutil.rmtree(work / f"export-tp{tp}", ignore_errors=True)
            shutil.rmtree(mcore, ignore_errors=True)
            if not args.skip_mbridge:
                from parallel.spawn import run_on_ranks

                log(f"megarl vs mbridge in memory, tp={tp}, {args.repeats} repeat(s)")
                result = run_on_ranks(in_memory_rank, tp, str(hf_dir), str(work), {"tp": tp}, args.repeats,
                                      timeout_s=1800, env=threads_env(tp))[0]
                mem_rows.append((tp, result))
                log("  " + ", ".join(f"{k} {min(v):.2f} s" for k, v in result["times"].items())
                    + f"; loaded weights identical: {result['identical']}")
        load_after = os.getloadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    gb = ckpt_bytes / 1e9
    print()
    print(f"{args.preset}: {params / 1e6:.1f}M parameters, HF checkpoint {ckpt_bytes / 1e6:.1f} MB (fp32); "
          f"min of {args.repeats} run(s); OMP_NUM_THREADS = cores // ranks")
    print(f"load average before {load_before[0]:.2f} / after {load_after[0]:.2f} (1 min) on {os.cpu_count()} cores")
    print(f"file copy (shutil.copyfile, warm cache, min of {max(3, args.repeats)}): {copy_s:.3f} s = {copy_gbps:.2f} GB/s")
    print()
    print("megarl convert (CLI path)")
    header = (f"{'direction':<16}{'tp':>3}{'verify':>7}{'wall s':>8}{'rank s':>8}{'GB/s':>7}{'x copy':>8}"
              f"{'RSS conv MB':>12}{'/model':>7}{'RSS all MB':>11}{'/model':>7}")
    print(header)
    print("-" * len(header))
    for direction, tp, verify, row in cli_rows:
        gbps = gb / row["seconds"]
        print(f"{direction:<16}{tp:>3}{'yes' if verify else 'no':>7}{row['wall']:>8.1f}{row['seconds']:>8.2f}"
              f"{gbps:>7.2f}{gbps / copy_gbps:>8.3f}{row['conversion_peak_rss_bytes'] / 1e6:>12.0f}"
              f"{row['conversion_peak_rss_bytes'] / ckpt_bytes:>7.2f}{row['peak_rss_bytes'] / 1e6:>11.0f}"
              f"{row['peak_rss_bytes'] / ckpt_bytes:>7.2f}")
    if mem_rows:
        print()
        print("megarl vs mbridge, same ranks/threads/layout, chunks already built (imports and model build excluded)")
        header = (f"{'phase':<8}{'tp':>3}{'megarl s':>10}{'GB/s':>7}{'x copy':>8}{'mbridge s':>11}"
                  f"{'mbridge/megarl':>16}{'identical':>11}")
        print(header)
        print("-" * len(header))
        for tp, result in mem_rows:
            for phase in ("load", "export"):
                ours, theirs = min(result["times"][f"megarl {phase}"]), min(result["times"][f"mbridge {phase}"])
                print(f"{phase:<8}{tp:>3}{ours:>10.3f}{gb / ours:>7.2f}{gb / ours / copy_gbps:>8.3f}{theirs:>11.3f}"
                      f"{theirs / ours:>16.2f}{str(result['identical']) if phase == 'load' else '':>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
