"""`bench/decode_profile.py` counts decode steps only: a prompt's chunk goes through the same
one C call as a decode step, and counting it would add its prefill to every decode figure."""

from __future__ import annotations

import argparse

import pytest
from gguf import GGMLQuantizationType as QType

from pagedkv.kernels import native
from tests.bench import load_script

decode_profile = load_script("decode_profile")


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
