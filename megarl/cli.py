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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
