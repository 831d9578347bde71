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

import itertools
import json
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
import json, sys, torch
from tests.kernels.test_builds import forward_logits
from pagedkv.kernels import native
assert native.kernels() is not None, native.unavailable_reason()
print(native.kernels().vector_path)
cases = json.loads(sys.argv[1])
torch.save({case: forward_logits(*settings) for case, settings in cases.items()}, sys.argv[2])
"""

# Head sizes on either side of the vector widths (8 and 16 floats), with and without a tail,
# and query heads per KV head that leave a tile an odd number of query vectors.
HEAD_DIMS = (4, 8, 12, 20, 24, 64, 72, 80, 128)
GROUPS = (1, 3, 4)
CACHE_DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16, 3: torch.uint8}


def attention_outputs() -> torch.Tensor:
    """`pagedkv_attention` over every head size, group and cache dtype (fp8 read through a
    table), with and without a sliding window: one step of two decoding sequences, a prompt
    chunk of 45 rows after 30 cached positions and a 3-row chunk, all outputs as one tensor.
    Two keys of the float caches are NaN: every build passes over their scores alike."""
    kernels = native.kernels()
    gen = torch.Generator().manual_seed(0)
    block_size, rows = 16, [1, 1, 45, 3]
    contexts = torch.tensor([130, 7, 75, 40], dtype=torch.int32)
    tables = torch.arange(40, dtype=torch.int32).reshape(4, 10)
    starts = torch.tensor([0, 1, 2, 47, 50], dtype=torch.int64)
    fp8_table = torch.randn(256, generator=gen)
    outputs = []
    for head_dim, group, code, window in itertools.product(
        HEAD_DIMS, GROUPS, CACHE_DTYPES, (0, 13)
    ):
        kv_heads = 2
        shape = (40, block_size, kv_heads, head_dim)
        if code == 3:
            k_cache, v_cache = (torch.randint(0, 256, shape, generator=gen).byte() for _ in "kv")
        else:
            k_cache, v_cache = (
                torch.randn(shape, generator=gen).to(CACHE_DTYPES[code]) for _ in "kv"
            )
            k_cache[20, 5, 0, 0] = k_cache[21, 9, 1, head_dim - 1] = float("nan")
        q = torch.randn(sum(rows), group * kv_heads, head_dim, generator=gen)
        out = torch.empty_like(q)
        status = kernels.attention(
            q.data_ptr(), group * kv_heads * head_dim, k_cache.data_ptr(), v_cache.data_ptr(),
            code, fp8_table.data_ptr() if code == 3 else None, 0.7, 1.3, tables.data_ptr(),
            tables.shape[1], starts.data_ptr(), contexts.data_ptr(),
            len(contexts), group * kv_heads, kv_heads, head_dim, block_size, head_dim**-0.5, window,
            out.data_ptr(),
        )  # fmt: skip
        assert status == 0
        outputs.append(out.flatten())
    return torch.cat(outputs)


# Tiles' sizes (and so which paths a tile takes) follow the thread count.
THREAD_COUNTS = (1, 3)


def attention_outputs_by_threads() -> dict[int, torch.Tensor]:
    """`attention_outputs` on each of THREAD_COUNTS threads (torch's OpenMP pool, which the
    kernels share)."""
    threads = torch.get_num_threads()
    try:
        outputs = {}
        for count in THREAD_COUNTS:
            torch.set_num_threads(count)
            outputs[count] = attention_outputs()
        return outputs
    finally:
        torch.set_num_threads(threads)


ATTENTION_CHILD = """
import sys, torch
from tests.kernels.test_builds import attention_outputs_by_threads
from pagedkv.kernels import native
assert native.kernels() is not None, native.unavailable_reason()
print(native.kernels().vector_path)
torch.save(attention_outputs_by_threads(), sys.argv[1])
"""


def run_build(target: str, child: str, *args: str) -> str:
    """`child` run with `args` in a fresh process whose kernels are built for `target`; its
    output line (the vector path it ran)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PAGEDKV_MARCH=target)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", child, *args], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


# (GGUF type or None for the folder, quantization, dtype): every weight path of the kernels.
WEIGHT_CASES = [
    (None, "int4", "float32"),
    (None, "int8", "float32"),
    (None, "none", "float32"),
    (None, "none", "bfloat16"),
    (QType.Q4_1, "auto", "float32"),  # float16 scales and mins
    (QType.Q8_0, "auto", "float32"),
]


def test_every_build_computes_the_same_logits(zoo, tiny_gguf, tmp_path):
    """qwen2 (a tied head, q/k/v biases, a sliding window), from its folder or a GGUF file, in
    every weight format: each build's logits are this process's. One child per build runs
    every case, since each child spends seconds importing torch."""
    if native.kernels() is None:
        pytest.skip(f"C kernels unavailable: {native.unavailable_reason()}")
    cases = {
        f"{qtype.name if qtype else 'folder'}-{quantization}-{dtype}": (
            str(zoo.folder("qwen2") if qtype is None else tiny_gguf("qwen2", qtype=qtype)),
            quantization,
            dtype,
        )
        for qtype, quantization, dtype in WEIGHT_CASES
    }
    ours = {case: forward_logits(*settings) for case, settings in cases.items()}
    for target in TARGETS:
        out = tmp_path / f"{target}.pt"
        path = run_build(target, CHILD, json.dumps(cases), str(out))
        theirs = torch.load(out)
        assert theirs.keys() == ours.keys()
        for case, logits in ours.items():
            assert torch.equal(theirs[case], logits), (
                f"{target} build ({path}), {case}: differs by up to "
                f"{(theirs[case] - logits).abs().max():.3g}"
            )


def test_every_build_attends_with_the_same_bits(tmp_path):
    """Attention alone, over head sizes, groups and cache dtypes the model zoo does not reach:
    the AVX-512 build's 16-lane paths (query vectors in pairs, masked value columns) give the
    bits of the AVX2 build's 8-lane ones and of the plain-C twins. Each build runs on 1 and 3
    threads, since the tiles' sizes (and so which paths a tile takes) follow the thread
    count: this process's build here, the others in a child each."""
    if native.kernels() is None:
        pytest.skip(f"C kernels unavailable: {native.unavailable_reason()}")
    ours = attention_outputs()
    assert torch.isfinite(ours).all()
    builds = {f"native ({native.kernels().vector_path})": attention_outputs_by_threads()}
    for target in TARGETS:
        out = tmp_path / f"{target}.pt"
        path = run_build(target, ATTENTION_CHILD, str(out))
        builds[f"{target} ({path})"] = torch.load(out)
    for build, by_threads in builds.items():
        assert sorted(by_threads) == sorted(THREAD_COUNTS)
        for threads, theirs in by_threads.items():
            assert torch.equal(theirs, ours), (
                f"{build} build on {threads} threads differs by up to "
                f"{(theirs - ours).abs().max():.3g}"
            )
