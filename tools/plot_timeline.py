#!/usr/bin/env python
"""Draw a run's timeline (``<output_dir>/timeline.json``) as a PNG: one row per lane (the
controller's phases, the rollout's generation), one bar per phase, coloured by phase, seconds
from the first event on the x axis. Overlap between generation and training shows as bars of the
two rows side by side.

    python tools/plot_timeline.py runs/quickstart_grpo/timeline.json --output timeline.png [--steps 3-6]

Argument handling and drawing only; the trace is written by ``megarl.metrics.Timeline``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.metrics import Timeline, read_timeline  # noqa: E402


def plot(events: list[dict], output: str | Path, title: str = "") -> Path:
    """Draw ``events`` (``read_timeline``'s) into ``output`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min(e["ts"] for e in events)
    lanes = [lane for lane in Timeline.LANES if any(e["lane"] == lane for e in events)]
    phases = sorted({e["name"] for e in events})
    colours = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(phases)}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.8 * len(lanes)))
    for row, lane in enumerate(lanes):
        for name in phases:
            spans = [((e["ts"] - origin) / 1e6, e["dur"] / 1e6) for e in events if e["lane"] == lane and e["name"] == name]
            if spans:
                ax.broken_barh(spans, (row - 0.4, 0.8), color=colours[name], label=name)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("seconds")
    ax.set_title(title)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=len(unique))
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return Path(output)


def events_of_steps(events: list[dict], steps: range) -> list[dict]:
    """The events while the controller ran ``steps``: on every lane, so generation running ahead
    for later steps shows beside them (without controller phases there: the events of ``steps``)."""
    own = [e for e in events if e["args"]["step"] in steps]
    phases = [e for e in own if e["lane"] == "controller"]
    if not phases:
        return own
    start, end = min(e["ts"] for e in phases), max(e["ts"] + e["dur"] for e in phases)
    return [e for e in events if e["ts"] < end and e["ts"] + e["dur"] > start]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("timeline", help="a run's timeline.json")
    parser.add_argument("--output", default=None, help="PNG path (default: next to the timeline)")
    parser.add_argument("--steps", default=None, help="only while the controller ran these steps, e.g. 3-6")
    args = parser.parse_args(argv)
    try:
        events = read_timeline(args.timeline)
    except (OSError, ValueError) as exc:
        print(f"plot_timeline: cannot read {args.timeline}: {exc}", file=sys.stderr)
        return 2
    if args.steps:
        first, _, last = args.steps.partition("-")
        keep = range(int(first), int(last or first) + 1)
        events = events_of_steps(events, keep)
    if not events:
        print(f"plot_timeline: no phases in {args.timeline}" + (f" for steps {args.steps}" if args.steps else ""),
              file=sys.stderr)
        return 2
    output = args.output or str(Path(args.timeline).with_suffix(".png"))
    plot(events, output, title=f"{args.timeline}" + (f", steps {args.steps}" if args.steps else ""))
    print(f"plot_timeline: wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
