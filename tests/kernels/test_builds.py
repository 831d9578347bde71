"""The C kernels compute the same logits whatever instructions they were built for.

AVX-512 machines and AVX2-only ones run different builds of the same sources (`-march=native`),
so each build path is compiled here (`PAGEDKV_MARCH`: `haswell` for the AVX2 path without
VNNI, `x86-64` for the plain C twins) into its own library (the build key holds the target)
and runs the same forward
passes in a fresh process; the logits must equal this process's bit for bit. What this
machine cannot run (an AVX-512 build on an AVX2-only CPU) is skipped by the other machines'
runs of this test, each covering the paths below its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.kernels import native
from pagedkv.weights.load import load
from pagedkv.worker.kv_cache import KVCache
from tests.model.tiny_models import random_prompt

pytestmark = pytest.mark.slow
TARGETS = ("haswell", "x86-64")


def forward_logits(source: str, quantization: str, dtype: str) -> torch.Tensor:
    """A prompt's logits at every position, then 4 decode steps of it beside a second
    sequence, as one tensor."""
    model = load(source, quantization=quantization, dtype=dtype).model
    cache = KVCache.for_model(model, block_size=16, num_blocks=16)
    tables = [list(range(8)), list(range(8, 16))]
    prompts = [random_prompt(37, seed=1), random_prompt(20, seed=2)]
    first = [
        SequenceInput(p, 0, t, num_logits=len(p)) for p, t in zip(prompts, tables, strict=True)
    ]
    logits = [model(ForwardBatch.build(first, 16), cache)]
    for step in range(4):
        batch = [
            SequenceInput([5 + step], len(p) + step, t)
            for p, t in zip(prompts, tables, strict=True)
        ]
        logits.append(model(ForwardBatch.build(batch, 16), cache))
    return torch.cat(logits).float()


CHILD = """
import sys, torch
from tests.kernels.test_builds import forward_logits
from pagedkv.kernels import native
assert native.kernels() is not None, native.unavailable_reason()
print(native.kernels().vector_path)
torch.save(forward_logits(sys.argv[1], sys.argv[2], sys.argv[3]), sys.argv[4])
"""


@pytest.mark.parametrize(
    ("qtype", "quantization", "dtype"),
    [
        (None, "int4", "float32"),
        (None, "int8", "float32"),
        (None, "none", "float32"),
        (None, "none", "bfloat16"),
        (QType.Q4_1, "auto", "float32"),  # float16 scales and mins
        (QType.Q8_0, "auto", "float32"),
    ],
    ids=str,
)
def test_every_build_computes_the_same_logits(zoo, tiny_gguf, tmp_path, qtype, quantization, dtype):
    if native.kernels() is None:
        pytest.skip(f"C kernels unavailable: {native.unavailable_reason()}")
    # qwen2: a tied head, q/k/v biases, a sliding window; from its folder or a GGUF file
    source = str(zoo.folder("qwen2") if qtype is None else tiny_gguf("qwen2", qtype=qtype))
    ours = forward_logits(source, quantization, dtype)
    root = Path(__file__).resolve().parents[2]
    for target in TARGETS:
        env = dict(os.environ, PAGEDKV_MARCH=target)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        out = tmp_path / f"{target}.pt"
        args = [source, quantization, dtype, str(out)]
        result = subprocess.run(
            [sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr[-2000:]
        theirs = torch.load(out)
        assert torch.equal(theirs, ours), (
            f"{target} build ({result.stdout.strip()}) differs by up to "
            f"{(theirs - ours).abs().max():.3g}"
        )
