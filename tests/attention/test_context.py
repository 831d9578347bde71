"""The forward context: a layer's attention reads its step from it, only inside a forward pass."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention.backend import TorchAttention
from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.attention.context import ForwardContext, forward_context, get_forward_context
from pagedkv.attention.errors import NoForwardContext
from pagedkv.attention.fp8 import UNIT_SCALES
from pagedkv.attention.layer import Attention


class OneLayerCache:
    """A one-layer paged cache of one block of 16 slots."""

    def __init__(self) -> None:
        self.k_cache = torch.zeros(1, 16, 1, 8)
        self.v_cache = torch.zeros(1, 16, 1, 8)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache, self.v_cache

    def layer_scales(self, index: int):
        return UNIT_SCALES

    def check_dtype(self, kv_dtype: torch.dtype) -> None:
        pass


def step() -> ForwardContext:
    batch = ForwardBatch.build([SequenceInput([1, 2], 0, [0])], 16)
    return ForwardContext(batch, OneLayerCache(), torch.ones(2, 8), torch.zeros(2, 8))


def test_attention_outside_a_forward_pass_names_the_problem() -> None:
    attn = Attention(0, 1, 1, 8, None, TorchAttention())
    rows = torch.ones(2, 1, 8)
    with pytest.raises(NoForwardContext, match="no forward pass is running"):
        attn(rows, rows, rows)


def test_attention_writes_and_reads_the_step_of_the_context() -> None:
    attn = Attention(0, 1, 1, 8, None, TorchAttention())
    context = step()
    key = torch.arange(16.0).view(2, 1, 8)
    with forward_context(context):
        out = attn(torch.ones(2, 1, 8), key, key + 1)
    assert out.shape == (2, 1, 8)
    assert torch.equal(context.kv_cache.k_cache[0, :2], key)
    assert torch.equal(context.kv_cache.v_cache[0, :2], key + 1)


def test_the_context_is_unset_after_its_block_even_on_an_error() -> None:
    outer, inner = step(), step()
    with forward_context(outer):
        with pytest.raises(RuntimeError, match="layer failed"), forward_context(inner):
            assert get_forward_context() is inner
            raise RuntimeError("layer failed")
        assert get_forward_context() is outer
    with pytest.raises(NoForwardContext):
        get_forward_context()
