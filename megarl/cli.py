"""`megarl` command line: one entry point, one subcommand per job.

Subcommands grow with the project; each validates its arguments before any expensive work.
"""

from __future__ import annotations

import argparse
import sys
import time


def _demo(args: argparse.Namespace) -> int:
    """A tiny Megatron LM training run on local ranks (the smoke test of the whole stack)."""
    from megarl.pretrain_demo import DemoRun, train_on_rank
    from model_specs.presets import hf_config_dict
    from parallel.layout import LayoutError, MegatronLayout
    from parallel.spawn import run_on_ranks

    layout = MegatronLayout(tp=args.tp, pp=args.pp, vpp=args.vpp, sequence_parallel=args.sequence_parallel)
    world = args.world_size or layout.tp * layout.pp
    try:
        layout.validate(world, hf_config_dict(args.preset))
    except (LayoutError, KeyError) as error:
        print(f"megarl demo: {error}", file=sys.stderr)
        return 2
    run = DemoRun(preset=args.preset, layout=layout, steps=args.steps)
    print(f"megarl demo: training {args.preset} for {args.steps} steps on {world} CPU/GPU rank(s) "
          f"with tp={layout.tp} pp={layout.pp} vpp={layout.vpp} dp={layout.data_parallel_size(world)}", flush=True)
    start = time.monotonic()
    histories = run_on_ranks(train_on_rank, world, run, timeout_s=args.timeout)
    losses = next(h for h in reversed(histories) if h[0]["loss"] == h[0]["loss"])  # a last-stage rank
    for step, metrics in enumerate(losses):
        print(f"step {step + 1:3d}/{args.steps}  loss {metrics['loss']:.4f}  grad_norm {metrics['grad_norm']:.3f}")
    first, last = losses[0]["loss"], losses[-1]["loss"]
    print(f"megarl demo: loss {first:.3f} -> {last:.3f} in {time.monotonic() - start:.1f} s")
    return 0 if last < first else 1


def _check_config(args: argparse.Namespace) -> int:
    """Load a run config (YAML + presets + key=value overrides), validate it, print it resolved."""
    from megarl.config import ConfigError, load_config, to_yaml

    try:
        config = load_config(args.config, args.overrides, check_files=not args.skip_file_checks)
    except ConfigError as error:
        for line in error.problems:
            print(f"megarl: config error: {line}", file=sys.stderr)
        return 2
    print(to_yaml(config), end="")
    return 0


EXIT_STOPPED = 143  # `megarl train` stopped by SIGTERM before its last step (128 + SIGTERM), checkpoint saved


def _train(args: argparse.Namespace) -> int:
    """Run PPO/GRPO as configured: validate everything first, then Ray, workers, engines, steps.
    Exit status: 0 done, 2 bad config or run error, 143 stopped by SIGTERM with a checkpoint saved."""
    return _run_trainer(args, "train")


def _sft(args: argparse.Namespace) -> int:
    """Supervised fine-tuning on chat conversations (loss on assistant tokens), with the same
    layouts, checkpoints, resume and export as train. Exit status as for train."""
    return _run_trainer(args, "sft")


def _run_trainer(args: argparse.Namespace, command: str) -> int:
    from megarl.config import ConfigError, load_config, save_resolved

    try:
        config = load_config(args.config, args.overrides, mode="sft" if command == "sft" else "rl")
    except ConfigError as error:
        for line in error.problems:
            print(f"megarl {command}: config error: {line}", file=sys.stderr)
        return 2
    from megarl.controller.rl import RLTrainer
    from megarl.controller.sft import SFTTrainer
    from megarl.controller.worker_group import RunError

    save_resolved(config, config.trainer.output_dir)
    trainer = None
    try:
        try:
            trainer = (SFTTrainer if command == "sft" else RLTrainer)(config)
        except ValueError as error:  # the data (a bad row, a chat template): named in the message
            raise RunError(str(error)) from error
        history = trainer.fit()
        if trainer.step >= config.trainer.total_steps and not args.no_export:
            print(f"megarl {command}: exported the actor to {trainer.export_hf()}", flush=True)
    except RunError as error:
        print(f"megarl {command}: {error}", file=sys.stderr)
        return 2
    finally:
        if trainer is not None:
            trainer.close()
    key, name = trainer.HEADLINE
    if len(history) >= 2:
        first, last = history[0][key], history[-1][key]
        print(f"megarl {command}: {name} {first:.3f} (step {history[0]['step']}) -> {last:.3f} "
              f"(step {history[-1]['step']})")
    if trainer.step < config.trainer.total_steps:  # stopped by SIGTERM after saving: resume to finish
        print(f"megarl {command}: stopped at step {trainer.step}/{config.trainer.total_steps} (checkpoint saved); "
              f"run the same command again to resume", file=sys.stderr)
        return EXIT_STOPPED
    return 0


def _convert(args: argparse.Namespace) -> int:
    """Convert HF safetensors <-> Megatron distributed checkpoints at any TP/PP/VPP (and, for MoE
    models, EP/ETP) layout."""
    import dataclasses
    import math
    import os
    from pathlib import Path

    from model_specs import check_layer_spec, num_experts
    from parallel.checkpoint.dist_ckpt import read_checkpoint_metadata
    from parallel.checkpoint.errors import CheckpointError
    from parallel.checkpoint.hf_io import HFCheckpoint
    from parallel.layout import LayoutError, MegatronLayout

    layout = MegatronLayout(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp)
    under_launcher = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_launcher else math.lcm(layout.tp, layout.ep * layout.etp) * layout.pp
    layer_spec = args.layer_spec or "local"
    try:  # everything checkable is checked here, before any rank starts
        check_layer_spec(layer_spec, "--layer-spec")
        if args.layer_spec is not None and args.direction == "megatron-to-hf":
            raise ValueError(f"--layer-spec={args.layer_spec!r} applies to hf-to-megatron (the spec the checkpoint "
                             "is written for); megatron-to-hf reads checkpoints of either spec: drop --layer-spec")
        if Path(args.output).exists():
            raise CheckpointError(f"--output {args.output} already exists; choose a new directory or remove it")
        if args.direction == "hf-to-megatron":
            hf_config = HFCheckpoint(args.input).config
        else:
            hf_config = read_checkpoint_metadata(args.input)["hf_config"]
        if layout.tp > 1 and num_experts(hf_config):  # megatron's MoE runs TP only with SP; no weight depends on it
            layout = dataclasses.replace(layout, sequence_parallel=True)
        layout.validate(world, hf_config)
    except (CheckpointError, LayoutError, ValueError) as error:
        print(f"megarl convert: {error}", file=sys.stderr)
        return 2
    from parallel.checkpoint.convert import conversion_on_rank  # megatron's imports (~6 s): only for a valid request
    from parallel.spawn import run_on_ranks

    first = not under_launcher or os.environ.get("RANK") == "0"
    try:  # every failure: one line, exit status 2, nothing published at --output or left beside it
        if under_launcher:  # torchrun / srun: this process is one rank
            import torch.distributed as dist

            from parallel.cpu import compat as cpu_compat
            from parallel.process_groups import distributed_backend

            cpu_mode = cpu_compat.apply()
            if not cpu_mode:  # the launcher's local rank picks this rank's GPU
                import torch

                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(distributed_backend(cuda_available=not cpu_mode))
            report = conversion_on_rank(args.direction, args.input, args.output, layout, not args.no_verify,
                                        layer_spec)
            dist.destroy_process_group()
        else:
            report = run_on_ranks(conversion_on_rank, world, args.direction, args.input, args.output, layout,
                                  not args.no_verify, layer_spec, timeout_s=args.timeout)[0]
    except Exception as error:  # noqa: BLE001 - reported as one line, not a traceback
        if first:
            _remove_unpublished(Path(args.output))
        print(f"megarl convert: {_one_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if first:
            _remove_unpublished(Path(args.output))
        raise
    if first:
        probe = (f", {report['peak_rss_bytes'] / 2**20:.0f} MiB with the verification's logit probe"
                 if report["peak_rss_bytes"] > report["conversion_peak_rss_bytes"] else "")
        print(f"megarl convert: done: {report['tensors']} tensors in {report['seconds']:.1f} s, "
              f"peak RSS {report['conversion_peak_rss_bytes'] / 2**20:.0f} MiB converting (largest rank){probe}")
    return 0


def _one_line(error: BaseException) -> str:
    """What a failed conversion says: the message of the exception that stopped it (a failed
    rank's traceback comes down to its last line), without the module path of megarl's own
    errors (they name the file or tensor and the fix); other exceptions keep their type."""
    import re

    from parallel.spawn import RankFailedError

    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if isinstance(error, RankFailedError) and lines:
        text = lines[-1]  # the traceback's last line: "module.Type: message"
    elif isinstance(error, (ValueError, TimeoutError)):  # CheckpointError, LayoutError, a timeout
        text = " ".join(lines)
    else:
        text = f"{type(error).__name__}: {' '.join(lines)}"
    return re.sub(r"^(?:[\w.]+\.)?(?:CheckpointError|LayoutError|UnsupportedModelError): ", "", text) or repr(error)


def _remove_unpublished(output) -> None:
    """After a failed conversion: remove the partial directory beside ``output`` that a rank killed
    before cleaning up may have left (``output`` itself only ever appears complete and verified:
    the rename is the conversion's last step)."""
    import shutil

    from parallel.checkpoint.atomic import partial_dir

    shutil.rmtree(partial_dir(output), ignore_errors=True)


def _verify(args: argparse.Namespace) -> int:
    """Compare two checkpoints (HF or megarl Megatron, any saved layout) tensor by tensor."""
    from parallel.checkpoint.verify import verify_on_rank
    from parallel.layout import MegatronLayout
    from parallel.spawn import RankFailedError, run_on_ranks

    layout = MegatronLayout(tp=args.tp, pp=args.pp, vpp=args.vpp)
    try:
        report = run_on_ranks(verify_on_rank, layout.tp * layout.pp, args.a, args.b, layout, timeout_s=args.timeout)[0]
    except RankFailedError as error:
        reason = str(error).strip().splitlines()[-1]
        print(f"megarl verify: {reason}", file=sys.stderr)
        return 2
    print(f"megarl verify: {report['tensors']} tensors compared; max logit difference {report['max_logit_diff']:.3g}")
    for name, diff in report["different_tensors"].items():
        print(f"  differs: {name} (max abs diff {diff:.3g})")
    for where in report["checksum_mismatches"]:
        print(f"  recorded checksum does not match the data: {where}")
    print("megarl verify: identical" if report["identical"] else "megarl verify: DIFFERENT")
    return 0 if report["identical"] else 1


def _plan(args: argparse.Namespace) -> int:
    """Dry-run a launch: validate the config, print per-role layout and per-GPU memory vs a budget.

    Exit status: 0 fits, 1 does not fit in memory, 2 config or allocation error."""
    from megarl.config import ConfigError, load_config
    from megarl.launch_plan import driver_command, format_plan, plan_run, slurm_geometry_problems

    try:
        config = load_config(args.config, args.overrides, check_files=args.check_files)
    except ConfigError as error:
        for line in error.problems:
            print(f"megarl plan: config error: {line}", file=sys.stderr)
        return 2
    geometry = slurm_geometry_problems(config, args.slurm_nodes, args.slurm_gpus_per_node)
    for line in geometry:
        print(f"megarl plan: allocation error: {line}", file=sys.stderr)
    if geometry:
        return 2
    if args.conversion:  # the conversion job at the actor's layout (cluster.* = its ranks)
        from megarl.launch_plan import conversion_plan

        print(conversion_plan(config, config.cluster.ranks_per_node, verify=not args.no_verify))
        return 0
    plan = plan_run(config, gpu_memory_gib=args.gpu_memory_gib, recompute=args.recompute)
    if args.json:
        import json

        print(json.dumps(plan.to_dict(), indent=1))
    else:
        print(format_plan(plan))
        print(f"driver: {driver_command(args.config, args.overrides)}")
    return 0 if plan.fits else 1


# megarl preflight's floors: flag -> (environment variable, parallel.preflight_host.Floors field, type, meaning).
PREFLIGHT_FLOORS = {
    "--intra-node-floor-gb-s": ("MEGARL_PREFLIGHT_INTRA_GBPS", "intra_node_gb_s", float,
                                "NCCL all_reduce bus bandwidth floor within a node, GB/s (no floor on CPU)"),
    "--inter-node-floor-gb-s": ("MEGARL_PREFLIGHT_INTER_GBPS", "inter_node_gb_s", float,
                                "NCCL all_reduce bus bandwidth floor over all nodes' GPUs, GB/s (no floor on CPU)"),
    "--min-shm-gib": ("MEGARL_PREFLIGHT_SHM_GIB", "shm_gib", float, "/dev/shm floor on GPU nodes, GiB (CPU nodes: at most 1)"),
    "--min-nofile": ("MEGARL_PREFLIGHT_NOFILE", "nofile", int, "ulimit -n floor"),
}


def _preflight(args: argparse.Namespace) -> int:
    """Check a multi-node allocation before Ray starts: one task per node (srun) reports its host,
    GPU count, ulimits, /dev/shm, driver and GPU health, then runs one rank per GPU in large
    all_reduces within each node and across all nodes, judged against bandwidth floors, and reads
    NCCL's transport between nodes; failures name the node(s).

    Rank and world size (nodes) come from SLURM_PROCID/SLURM_NTASKS (or RANK/WORLD_SIZE) unless given.
    Exit status: 0 usable, 1 a node failed a check, 2 bad arguments."""
    import os

    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's connect retries: our message names the node
    from parallel.preflight import PreflightError, run_preflight
    from parallel.preflight_host import Floors

    env = os.environ
    rank = args.rank if args.rank is not None else int(env.get("SLURM_PROCID", env.get("RANK", 0)))
    world = args.world_size if args.world_size is not None else int(env.get("SLURM_NTASKS", env.get("WORLD_SIZE", 1)))
    hosts = [h for h in args.hosts.split(",") if h] if args.hosts else None
    master = args.master_addr or env.get("MASTER_ADDR") or (hosts[0] if hosts else None)
    if master is None or not 0 <= rank < world or (hosts and len(hosts) != world):
        print(f"megarl preflight: need --master-addr (or MASTER_ADDR), 0 <= rank < world size (got {rank}/{world}) "
              f"and one --hosts entry per rank", file=sys.stderr)
        return 2
    for name in ("bytes", "iters", "ranks_per_node"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"megarl preflight: --{name.replace('_', '-')} {value}: must be >= 1", file=sys.stderr)
            return 2
    values = {}
    for flag, (variable, name, kind, _) in PREFLIGHT_FLOORS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        try:
            values[name] = kind(env.get(variable, getattr(Floors, name))) if value is None else value
        except ValueError:
            print(f"megarl preflight: {variable}={env[variable]!r} is not a number: unset it or use {flag}",
                  file=sys.stderr)
            return 2
    floors = Floors(**values, min_driver=args.min_driver or env.get("MEGARL_PREFLIGHT_MIN_DRIVER") or None,
                    allow_nccl_socket=args.allow_nccl_socket or env.get("MEGARL_PREFLIGHT_ALLOW_NCCL_SOCKET") == "1")
    try:
        result = run_preflight(rank, world, master, args.master_port, hosts=hosts, gpus_per_node=args.gpus_per_node,
                               timeout_s=args.timeout, nbytes=args.bytes, ranks_per_node=args.ranks_per_node,
                               iters=args.iters, warmup=args.warmup, floors=floors)
    except PreflightError as error:
        print(f"megarl preflight: ERROR: {error}", file=sys.stderr, flush=True)
        return 1
    if rank == 0:
        print(result.summary(), flush=True)
    return 0 if result.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help=_demo.__doc__)
    demo.add_argument("--preset", default="tiny-llama", help="model preset (model_specs/presets.py)")
    demo.add_argument("--tp", type=int, default=2)
    demo.add_argument("--pp", type=int, default=1)
    demo.add_argument("--vpp", type=int, default=None)
    demo.add_argument("--sequence-parallel", action="store_true")
    demo.add_argument("--world-size", type=int, default=None, help="default: tp*pp (dp=1)")
    demo.add_argument("--steps", type=int, default=8)
    demo.add_argument("--timeout", type=float, default=600.0, help="seconds before all ranks are killed")
    demo.set_defaults(func=_demo)
    check = sub.add_parser("check-config", help=_check_config.__doc__)
    check.add_argument("config", help="run config YAML (e.g. configs/quickstart_grpo.yaml)")
    check.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. rollout.n=8 actor.optim.lr=1e-6")
    check.add_argument("--skip-file-checks", action="store_true",
                       help="do not require data files and the resume checkpoint to exist on this machine")
    # Overrides may also follow the options (argparse alone stops a nargs="*" list at the first option).
    check.set_defaults(func=_check_config, trailing_positionals="overrides")

    plan = sub.add_parser("plan", help=_plan.__doc__.splitlines()[0], description=_plan.__doc__)
    plan.add_argument("config", help="run config YAML (e.g. configs/llama3_70b_grpo_32x8.yaml)")
    plan.add_argument("overrides", nargs="*", help="dotted key=value overrides, as for train")
    plan.add_argument("--gpu-memory-gib", type=float, default=None,
                      help="per-GPU memory budget in GiB (default: the config's cluster.gpu_memory_gib)")
    plan.add_argument("--recompute", choices=["none", "selective", "full"], default=None,
                      help="activation recompute assumed (default: the config's actor.recompute)")
    plan.add_argument("--check-files", action="store_true", help="also require the data files to exist here")
    plan.add_argument("--slurm-nodes", type=int, default=None, help="the allocation's node count, checked against cluster.nodes")
    plan.add_argument("--slurm-gpus-per-node", type=int, default=None, help="checked against cluster.gpus_per_node")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--conversion", action="store_true",
                      help="plan `megarl convert` at the actor's layout over cluster.* ranks instead of training")
    plan.add_argument("--no-verify", action="store_true", help="with --conversion: the conversion skips read-back")
    plan.set_defaults(func=_plan, trailing_positionals="overrides")

    train = sub.add_parser("train", help=_train.__doc__)
    train.add_argument("config", help="run config YAML (e.g. configs/quickstart_grpo.yaml)")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.total_steps=5")
    train.add_argument("--no-export", action="store_true", help="do not write the final actor as HF")
    train.set_defaults(func=_train, trailing_positionals="overrides")

    sft = sub.add_parser("sft", help=_sft.__doc__, description=_sft.__doc__)
    sft.add_argument("config", help="run config YAML (e.g. configs/sft_chat_arith.yaml)")
    sft.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.total_steps=5")
    sft.add_argument("--no-export", action="store_true", help="do not write the final model as HF")
    sft.set_defaults(func=_sft, trailing_positionals="overrides")

    convert = sub.add_parser("convert", help=_convert.__doc__, description=_convert.__doc__ + (
        " Runs lcm(tp, ep*etp)*pp local ranks, or one rank per process under torchrun/srun (WORLD_SIZE/RANK set). "
        "Verification (on by default): every tensor checked against the source, checksums recorded, "
        "the written checkpoint read back, and a logit probe against HF transformers over 256 positions "
        "(or the model's context if shorter), "
        "all before the output is renamed into place. Exit status: 0 done, 2 refused or failed (one line "
        "on stderr; nothing is left at or beside --output)."))
    convert.add_argument("direction", choices=["hf-to-megatron", "megatron-to-hf"])
    convert.add_argument("--input", required=True, help="HF checkpoint dir, or megarl Megatron checkpoint dir")
    convert.add_argument("--output", required=True, help="new directory (written atomically)")
    convert.add_argument("--tp", type=int, default=1, help="layout used for the conversion ranks")
    convert.add_argument("--pp", type=int, default=1)
    convert.add_argument("--vpp", type=int, default=None)
    convert.add_argument("--ep", type=int, default=1, help="MoE models: expert parallelism (whole experts per rank)")
    convert.add_argument("--etp", type=int, default=1, help="MoE models: expert tensor parallelism (each expert split)")
    convert.add_argument("--no-verify", action="store_true", help="skip read-back and logit probe")
    convert.add_argument("--layer-spec", default=None, metavar="{local,te}",
                         help="hf-to-megatron: write the checkpoint as a model of megatron's local spec (default) "
                              "or Transformer Engine spec (norms fused into linear_qkv/linear_fc1) saves it; both "
                              "hold the same keys and load into either")
    convert.add_argument("--timeout", type=float, default=3600.0)
    convert.set_defaults(func=_convert)

    verify = sub.add_parser("verify", help=_verify.__doc__, description=_verify.__doc__ + (
        " Exit status: 0 identical, 1 different, 2 unusable input."))
    verify.add_argument("a", help="checkpoint directory (HF or megarl Megatron)")
    verify.add_argument("b", help="checkpoint directory (HF or megarl Megatron)")
    verify.add_argument("--tp", type=int, default=1, help="layout Megatron checkpoints are loaded at")
    verify.add_argument("--pp", type=int, default=1)
    verify.add_argument("--vpp", type=int, default=None)
    verify.add_argument("--timeout", type=float, default=3600.0)
    verify.set_defaults(func=_verify)

    preflight = sub.add_parser("preflight", help=_preflight.__doc__.splitlines()[0], description=_preflight.__doc__)
    preflight.add_argument("--master-addr", default=None, help="rank 0's IP (default: $MASTER_ADDR, else the first --hosts)")
    preflight.add_argument("--master-port", type=int, default=29555, help="rendezvous port on rank 0 (default 29555)")
    preflight.add_argument("--rank", type=int, default=None, help="default: $SLURM_PROCID, else $RANK")
    preflight.add_argument("--world-size", type=int, default=None, help="default: $SLURM_NTASKS, else $WORLD_SIZE")
    preflight.add_argument("--hosts", default=None, help="comma-separated host of each rank, to name missing ones")
    preflight.add_argument("--gpus-per-node", type=int, default=None, help="expected visible GPUs per node (0 on CPU)")
    preflight.add_argument("--timeout", type=float, default=60.0, help="seconds every wait is bounded by")
    preflight.add_argument("--bytes", type=int, default=None,
                           help="all_reduce size in bytes for the bandwidth checks (default 1 GiB on GPUs, 4 MiB on CPU)")
    preflight.add_argument("--iters", type=int, default=10, help="timed all_reduce iterations (default 10)")
    preflight.add_argument("--warmup", type=int, default=3, help="untimed all_reduce iterations first (default 3)")
    preflight.add_argument("--ranks-per-node", type=int, default=None,
                           help="collective ranks per node (default: one per visible GPU; 1 on CPU)")
    from parallel.preflight_host import Floors

    for flag, (variable, name, kind, what) in PREFLIGHT_FLOORS.items():
        preflight.add_argument(flag, type=kind, default=None,
                               help=f"{what} (default ${variable}, else {getattr(Floors, name):g}; 0 turns the check off)")
    preflight.add_argument("--min-driver", default=None,
                           help="oldest NVIDIA driver accepted (default $MEGARL_PREFLIGHT_MIN_DRIVER, else the oldest "
                                "torch's CUDA build runs on)")
    preflight.add_argument("--allow-nccl-socket", action="store_true",
                           help="accept NCCL over sockets between nodes (a cluster without RDMA) with a warning "
                                "(also $MEGARL_PREFLIGHT_ALLOW_NCCL_SOCKET=1)")
    preflight.set_defaults(func=_preflight)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    trailing = getattr(args, "trailing_positionals", None)
    if extra:
        if trailing is None or any(arg.startswith("-") for arg in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        setattr(args, trailing, [*getattr(args, trailing), *extra])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
