"""bench/gpu_check.py's kernel part runs end to end at tiny shapes on the CPU (its dry run).

The script's real run needs a GPU no CI machine has; this keeps its code paths working.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the real run covers it")
def test_kernel_figures_dry_run() -> None:
    """Every kernel figure line is printed, with a small error against dense attention."""
    result = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "kernels", "--device", "cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("of copy (goal >= 80%") == 2
    assert "paged / dense SDPA" in result.stdout
    errors = [
        float(line.rsplit(" ", 1)[1])
        for line in result.stdout.splitlines()
        if "relative error vs dense" in line
    ]
    assert len(errors) == 3 and max(errors) < 1e-5, result.stdout


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the real run covers it")
def test_agreement_dry_run() -> None:
    """The agreement part checks the engine's greedy tokens and logprobs against transformers'
    logits, with a float32 and an fp8 KV cache, with speculative decoding and with LoRA adapters
    (against the adapters merged into the weights), and finds them agreeing on the CPU."""
    result = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "agreement", "--device", "cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("agreement")]
    assert len(lines) == 5 and all(line.endswith("met)") for line in lines), result.stdout
