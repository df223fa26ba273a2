"""Compare two checkpoints: `python tools/verify_checkpoint.py A B [--tp 2]` (HF or Megatron, any layout).

Argument handling only; the work is `megarl verify` (megarl/cli.py -> parallel/checkpoint/verify.py).
"""

import sys

from megarl.cli import main

if __name__ == "__main__":
    sys.exit(main(["verify", *sys.argv[1:]]))
