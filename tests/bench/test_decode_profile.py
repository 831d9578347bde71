"""`bench/decode_profile.py` counts decode steps only: a prompt's chunk goes through the same
one C call as a decode step, and counting it would add its prefill to every decode figure."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QType

from pagedkv.kernels import native

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load_decode_profile():
    sys.path.insert(0, str(BENCH))  # it imports its sibling peers.py, as when run from bench/
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_decode_profile", BENCH / "decode_profile.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


decode_profile = _load_decode_profile()


def test_the_prompts_steps_are_left_out(tiny_gguf, monkeypatch) -> None:
    if native.kernels() is None:
        pytest.skip(f"C kernels unavailable: {native.unavailable_reason()}")
    monkeypatch.setattr(decode_profile, "read_bandwidth", lambda threads: 1e10)
    lines: list[str] = []
    model = str(tiny_gguf("llama", qtype=QType.Q4_1))
    args = argparse.Namespace(
        model=model, qtype="Q4_1", prompt_len=40, max_tokens=6, rounds=2, threads=1
    )
    ms = decode_profile.profile(args, out=lines.append)
    # each request's first token comes from its prompt's step, the other 5 from decode steps
    assert "2 rounds, 10 decode steps" in lines[0]
    assert 0 < ms["layers (one C call)"] < ms["step"]
