#!/usr/bin/env python
"""The jaxspec OpenAI-compatible server: `python scripts/serve.py --model checkpoints/NAME
[--draft self --gamma 4] [--max-batch 64 --max-len 8192] [--host 127.0.0.1 --port 8000]`.
With no --model it fetches and serves smollm2-135m-instruct. Same as `jaxspec serve`."""

from jaxspec.server import main

if __name__ == "__main__":
    main()
