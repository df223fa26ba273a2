#!/usr/bin/env python
"""Write megarl prompt files (parquet or jsonl) from data you already have.

    python tools/prepare_data.py gsm8k --input train.jsonl --output data/gsm8k/train.parquet
    python tools/prepare_data.py math --input a.jsonl b.jsonl --output data/math/train.parquet --split train
    python tools/prepare_data.py synthetic-arith --output data/arith/train.parquet --num 2000 --seed 0
    python tools/prepare_data.py synthetic-chat --output data/chat_arith/train.jsonl --num 2000 --turns 2

Argument handling only; the conversion is megarl.data.prepare.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.data import prepare  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    for kind, help_text in (
        ("gsm8k", "GSM8K-style rows: 'question', 'answer' ending in '#### N'"),
        ("math", "MATH-style rows: 'problem', 'solution' with a \\boxed{} answer"),
    ):
        p = sub.add_parser(kind, help=help_text)
        p.add_argument("--input", nargs="+", required=True, help=".jsonl or .parquet files")
        p.add_argument("--output", required=True, help="output .parquet or .jsonl")
        p.add_argument("--split", default="train", help="recorded in extra_info.split")
        p.add_argument("--data-source", default=None, help="override the data_source (picks the reward)")
        p.add_argument("--skip-invalid", action="store_true", help="skip rows without a final answer instead of failing")
    p = sub.add_parser("synthetic-arith", help="the quickstart's arithmetic prompts ('3+4=')")
    p.add_argument("--output", required=True, help="output .parquet or .jsonl")
    p.add_argument("--num", type=int, default=1000, help="number of prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default="train")
    p.add_argument("--min-operand", type=int, default=0)
    p.add_argument("--max-operand", type=int, default=9)
    p.add_argument("--ops", default="+", help="operators to draw from, e.g. '+-'")
    p.add_argument("--min-answer", type=int, default=0)
    p.add_argument("--max-answer", type=int, default=9, help="negative: no upper bound (default 9: one digit)")
    p.add_argument("--partial-credit-scale", type=float, default=None, help="dense reward 1-|pred-target|/scale")
    p = sub.add_parser("synthetic-chat", help="arithmetic conversations for `megarl sft` (messages: question, answer, ...)")
    p.add_argument("--output", required=True, help="output .parquet or .jsonl")
    p.add_argument("--num", type=int, default=1000, help="number of conversations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--turns", type=int, default=2, help="question/answer pairs per conversation")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.mode == "synthetic-arith":
            written = prepare.write_synthetic_arith(
                args.output,
                args.num,
                seed=args.seed,
                split=args.split,
                partial_credit_scale=args.partial_credit_scale,
                min_operand=args.min_operand,
                max_operand=args.max_operand,
                ops=tuple(args.ops),
                min_answer=args.min_answer,
                max_answer=None if args.max_answer < 0 else args.max_answer,
            )
            skipped = 0
        elif args.mode == "synthetic-chat":
            written, skipped = prepare.write_synthetic_chat(args.output, args.num, seed=args.seed, turns=args.turns), 0
        else:
            written, skipped = prepare.convert_files(
                args.input, args.output, args.mode, split=args.split,
                data_source=args.data_source, skip_invalid=args.skip_invalid,
            )
    except (ValueError, FileNotFoundError) as exc:
        print(f"prepare_data: error: {exc}", file=sys.stderr)
        return 2
    what = "conversations" if args.mode == "synthetic-chat" else "prompts"
    print(f"wrote {written} {what} to {args.output}" + (f" ({skipped} invalid rows skipped)" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
