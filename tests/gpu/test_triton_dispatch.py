"""The dispatcher: PyTorch on the CPU (without importing triton), Triton on CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagedkv.model import triton_dispatch
from pagedkv.model.attention import key_bytes_per_block, write_kv
from pagedkv.model.attention_metadata import AttentionMetadata
from tests.gpu.paged_batch import dense_attention, make_batch


def test_cpu_install_never_imports_triton() -> None:
    """Importing the dispatcher and running it on the CPU leaves triton unloaded."""
    code = (
        "import sys, torch\n"
        "from pagedkv.model import triton_dispatch as d\n"
        "k = torch.zeros(1, 16, 1, 8)\n"
        "d.write_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), k, k.clone(), torch.zeros(1))\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cpu_tensors_take_the_pytorch_path() -> None:
    """On the CPU the PyTorch path runs, planned here or with the step's plan passed in."""
    batch = make_batch(
        [30, 9, 4],
        [1, 9, 2],
        block_size=16,
        num_kv_heads=2,
        group=2,
        head_dim=16,
        dtype=torch.float32,
    )
    args = (
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.context_lens,
        batch.query_start_loc,
        batch.max_query_len,
        batch.max_context_len,
        0.5,
        8,
    )
    out = triton_dispatch.paged_attention(*args)
    torch.testing.assert_close(out.double(), dense_attention(batch, 0.5, 8), atol=1e-5, rtol=1e-5)
    metadata = AttentionMetadata.build(
        batch.block_tables, [30, 9, 4], [1, 9, 2], 16, 8, key_bytes_per_block(batch.k_cache)
    )
    assert torch.equal(triton_dispatch.paged_attention(*args, metadata=metadata), out)

    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    new = torch.randn(2, 2, 16)
    triton_dispatch.write_kv(new, new + 1, k_cache, v_cache, torch.tensor([3, 40]))
    write_kv(new, new + 1, batch.k_cache, batch.v_cache, torch.tensor([3, 40]))
    assert torch.equal(k_cache, batch.k_cache) and torch.equal(v_cache, batch.v_cache)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_take_the_triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the Triton wrapper is called with the dispatcher's arguments unchanged."""
    from pagedkv.model import triton_attention

    calls = []
    monkeypatch.setattr(
        triton_attention, "triton_paged_attention", lambda *a: calls.append(a) or a[0]
    )
    query = torch.zeros(1, 1, 16, device="cuda")
    cache = torch.zeros(1, 16, 1, 16, device="cuda")
    lens = torch.ones(1, dtype=torch.int32, device="cuda")
    table = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    triton_dispatch.paged_attention(query, cache, cache, table, lens, starts, 1, 1, 1.0, None)
    assert len(calls) == 1 and calls[0][6:] == (1, 1, 1.0, None)
