"""`bench/matmul_bench.py` times every quantised weight of a model in both layouts and checks,
each pass, that the panel layout's products equal kernel order's bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
from gguf import GGMLQuantizationType as QType

from pagedkv import LLM
from pagedkv.kernels import native
from tests.bench import load_script

matmul_bench = load_script("matmul_bench")


@pytest.fixture
def tiny_model(tiny_gguf):
    kernels = native.kernels()
    if kernels is None or not kernels.panels:
        pytest.skip("the panel layout is read on AVX-512 VNNI builds only")
    path = tiny_gguf("llama", qtype=QType.Q4_1)
    return LLM(str(path), threads=1, num_gpu_blocks=8, swap_space_gb=0).engine.runner.model


def test_every_weight_is_timed_in_both_layouts(tiny_model) -> None:
    weights = matmul_bench.model_weights(tiny_model)
    assert weights and all(weight.layout == "panels" for weight in weights)
    lines: list[str] = []
    totals = matmul_bench.measure(tiny_model, (1, 3), rounds=1, out=lines.append)
    assert set(totals) == {(m, layout) for m in (1, 3) for layout in ("panels", "kernel")}
    assert all(us > 0 for us in totals.values())
    for m in (1, 3):
        rows = [line for line in lines[1:] if line.split()[0] == str(m)]
        counted = sum(int(line.split("(")[1].split(")")[0]) for line in rows[:-1])
        assert counted == len(weights) and "whole pass" in rows[-1]


def test_products_that_differ_stop_the_run(tiny_model, monkeypatch) -> None:
    exact = matmul_bench.kernel_order

    def off_by_a_scale(weight):
        twin = exact(weight)
        return dataclasses.replace(twin, scales=twin.scales * 2)

    monkeypatch.setattr(matmul_bench, "kernel_order", off_by_a_scale)
    with pytest.raises(SystemExit, match=r"products differ \(rows=1\)"):
        matmul_bench.measure(tiny_model, (1,), rounds=1, out=lambda line: None)
