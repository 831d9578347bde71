"""The forward pass creates every tensor on the model's device and never reads one back.

It runs on the `meta` device, whose tensors have shapes but no data: a tensor made without a
device lands on the CPU and mixing it with meta tensors raises, and `.item()`, `.tolist()` or
`int(tensor)` (a host sync per layer on a GPU) raise too. So CI catches a CPU-only tensor or a
host sync on a machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields, is_dataclass

import pytest
import torch

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.torch_backend import paged_attention
from pagedkv.model.config import load_config
from pagedkv.model.registry import ARCHITECTURES
from pagedkv.worker.kv_cache import KVCache


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3"])
def test_forward_on_the_meta_device(zoo, name: str) -> None:
    config = load_config(zoo.folder(name))
    model = ARCHITECTURES[config.architecture].model_class()(config).to("meta")
    cache = KVCache(
        num_layers=config.num_layers,
        num_blocks=64,
        block_size=16,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        device="meta",
    )
    sequences = [
        SequenceInput(list(range(3, 43)), 0, [5, 6, 7]),  # a whole prompt
        SequenceInput([9, 10, 11], 30, [1, 2, 3]),  # after a cached prefix
        SequenceInput([12], 70, [8, 9, 10, 11, 12]),  # decodes, past the 16-token window
        SequenceInput([13], 20, [13, 14]),
    ]
    batch = ForwardBatch.build(sequences, block_size=16, device="meta")

    logits = model(batch, cache)

    assert logits.device.type == "meta"
    assert logits.shape == (len(sequences), config.vocab_size)
    plans = list(batch._step_state.values())
    assert {window for _, window, _ in batch._step_state} == set(config.sliding_windows)
    assert all(tensor.device.type == "meta" for tensor in tensors_in((batch, *plans)))


def test_attention_rejects_a_plan_on_another_device() -> None:
    cache = torch.zeros(4, 16, 2, 8)
    block_tables = torch.zeros(1, 1, dtype=torch.int32, device="meta")
    metadata = AttentionMetadata.build(block_tables, [3], [3], 16, None, 1 << 10)
    with pytest.raises(ValueError, match="must be on one device"):
        paged_attention(torch.zeros(3, 4, 8), cache, cache, metadata, scale=1.0)


def tensors_in(value: object) -> Iterator[torch.Tensor]:
    """Every tensor held by dataclasses, tuples, lists and dicts nested in `value`."""
    if isinstance(value, torch.Tensor):
        yield value
    elif is_dataclass(value):
        for field in fields(value):
            yield from tensors_in(getattr(value, field.name))
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, tuple | list):
        for item in value:
            yield from tensors_in(item)
