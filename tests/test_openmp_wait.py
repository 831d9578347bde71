"""`import pagedkv` bounds how long OpenMP threads spin idle, before torch loads libgomp.

libgomp reads GOMP_SPINCOUNT once, when it loads (with torch), so the default must be in the
environment by then; a value the user set is theirs. bench/omp_contention.py measures why.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pagedkv

PROBE = (
    "import os, sys; import pagedkv; loaded = 'torch' in sys.modules; import torch; "
    "print(os.environ.get('GOMP_SPINCOUNT'), loaded)"
)


def probe(**variables: str) -> list[str]:
    """GOMP_SPINCOUNT as a fresh interpreter has it after `import pagedkv` then torch, and
    whether torch was already loaded when pagedkv's import finished."""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    env.update(variables)
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return result.stdout.split()


def test_the_spin_count_is_set_before_torch_loads() -> None:
    assert probe() == [pagedkv.SPIN_COUNT, "False"]


def test_a_spin_count_the_user_set_is_kept() -> None:
    assert probe(GOMP_SPINCOUNT="123") == ["123", "False"]
