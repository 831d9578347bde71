"""Engine throughput against transformers: `python bench/engine_bench.py [flags]`.

The same as `pagedkv bench [flags]`; the code lives in the `pagedkv.bench` package so the
installed command has it. Quick run: `--workload mixed --rounds 1`; the built-in model:
`--model smollm2-135m-instruct`. `--help` lists every flag.
"""

from __future__ import annotations

import sys

from pagedkv.bench.main import main

if __name__ == "__main__":
    sys.exit(main())
