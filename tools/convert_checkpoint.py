"""HF <-> Megatron checkpoint conversion: `python tools/convert_checkpoint.py hf-to-megatron --input HF --output CKPT --tp 2`.

Argument handling only; the work is `megarl convert` (megarl/cli.py -> parallel/checkpoint/convert.py).
"""

import sys

from megarl.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
