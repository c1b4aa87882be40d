#!/usr/bin/env python
"""The jaxspec OpenAI-compatible server: `python scripts/serve.py --model checkpoints/NAME
[--draft self --gamma 4] [--max-batch 64 --max-len 8192] [--host 127.0.0.1 --port 8000]`.
With no --model it fetches and serves smollm2-135m-instruct. Same as `jaxspec serve` (all its
arguments are checked before the model loads; compiled programs are cached across runs)."""

import sys


def main(argv=None):
    from jaxspec.args import require_server_extra

    require_server_extra("scripts/serve.py")  # a one-line remedy, not a traceback
    from jaxspec.cli import main as cli_main

    cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
