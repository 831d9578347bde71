"""The attention backend: chosen once per device, PyTorch off CUDA (without importing triton)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagedkv.attention import backend
from pagedkv.attention.backend import TorchAttention, TritonAttention, select_backend
from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.attention.torch_backend import write_kv
from tests.attention.triton.paged_batch import PagedBatch, dense_attention, make_batch

CONTEXT_LENS = [30, 9, 4]
QUERY_LENS = [1, 9, 2]


def paged() -> PagedBatch:
    return make_batch(
        CONTEXT_LENS,
        QUERY_LENS,
        block_size=16,
        num_kv_heads=2,
        group=2,
        head_dim=16,
        dtype=torch.float32,
    )


def forward_batch(paged: PagedBatch, device: str = "cpu") -> ForwardBatch:
    """The engine's batch over `paged`'s sequences and block tables (token ids are unused)."""
    tables = paged.block_tables.tolist()
    block_size = paged.k_cache.shape[1]
    return ForwardBatch.build(
        [
            SequenceInput([1] * q_len, c_len - q_len, tables[seq][: -(-c_len // block_size)])
            for seq, (c_len, q_len) in enumerate(zip(CONTEXT_LENS, QUERY_LENS, strict=True))
        ],
        block_size,
        device=device,
    )


def test_the_cpu_gets_pytorch_and_cuda_gets_triton_when_it_imports(monkeypatch) -> None:
    assert isinstance(select_backend("cpu"), TorchAttention)
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    assert isinstance(select_backend("cuda"), TritonAttention)
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    assert isinstance(select_backend("cuda:0"), TorchAttention)


def test_a_model_built_on_the_cpu_holds_one_backend_for_every_layer(zoo) -> None:
    model = zoo.ours("llama")
    backends = {id(layer.self_attn.attn.backend) for layer in model.layers}
    assert backends == {id(model.attention_backend)}
    assert isinstance(model.attention_backend, TorchAttention)


def test_a_cpu_run_never_imports_triton() -> None:
    code = (
        "import sys, torch\n"
        "from pagedkv.attention.backend import select_backend\n"
        "from pagedkv.attention.batch import ForwardBatch, SequenceInput\n"
        "b = select_backend('cpu')\n"
        "batch = ForwardBatch.build([SequenceInput([1, 2], 0, [0])], 16)\n"
        "k = torch.zeros(1, 16, 1, 8)\n"
        "b.write_kv(torch.ones(2, 1, 8), torch.ones(2, 1, 8), k, k.clone(), batch)\n"
        "b.attend(torch.ones(2, 1, 8), k, k, batch, 1.0, None)\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pytorch_attention_matches_dense_attention_and_plans_once_per_window() -> None:
    batch = paged()
    step = forward_batch(batch)
    torch_attention = TorchAttention()
    for window in (8, None):
        out = torch_attention.attend(batch.query, batch.k_cache, batch.v_cache, step, 0.5, window)
        expected = dense_attention(batch, 0.5, window)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    plans = dict(step._step_state)
    assert {window for _, window, _ in plans} == {8, None}
    torch_attention.attend(batch.query, batch.k_cache, batch.v_cache, step, 0.5, 8)
    assert step._step_state == plans  # a later layer reuses the step's plan

    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    new = torch.randn(step.slot_mapping.shape[0], 2, 16)
    torch_attention.write_kv(new, new + 1, k_cache, v_cache, step)
    write_kv(new, new + 1, batch.k_cache, batch.v_cache, step.slot_mapping)
    assert torch.equal(k_cache, batch.k_cache) and torch.equal(v_cache, batch.v_cache)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_attention_passes_the_batch_tensors_to_the_kernels(monkeypatch) -> None:
    from pagedkv.attention.triton import attention as triton_attention

    calls = []
    monkeypatch.setattr(
        triton_attention, "triton_paged_attention", lambda *a, **kw: calls.append(a) or a[0]
    )
    batch = paged()
    step = forward_batch(batch, device="cuda")
    batch = batch.to(torch.device("cuda"))
    TritonAttention().attend(batch.query, batch.k_cache, batch.v_cache, step, 1.0, None)
    assert len(calls) == 1 and calls[0][6:] == (max(QUERY_LENS), max(CONTEXT_LENS), 1.0, None)
    assert calls[0][3] is step.block_tables and not step._step_state
