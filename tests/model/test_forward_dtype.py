"""A forward pass over a KV cache of another dtype fails at once, naming both dtypes."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.attention.errors import KVCacheDtypeMismatch
from pagedkv.worker.kv_cache import KVCache


def test_forward_rejects_a_cache_of_another_dtype(zoo):
    model = zoo.ours("llama")  # float32
    cache = KVCache.for_model(model.config, block_size=16, num_blocks=4, dtype=torch.bfloat16)
    batch = ForwardBatch.build([SequenceInput([5, 6, 7], 0, [0])], block_size=16)
    with pytest.raises(KVCacheDtypeMismatch, match="float32.*bfloat16|bfloat16.*float32"):
        model(batch, cache)


def test_query_start_loc_marks_where_each_sequence_starts():
    batch = ForwardBatch.build(
        [
            SequenceInput([5, 6, 7], 0, [0]),
            SequenceInput([8], 20, [1, 2]),
            SequenceInput([9, 9], 0, [3]),
        ],
        block_size=16,
    )
    assert batch.query_start_loc.tolist() == [0, 3, 4, 6]
    assert batch.query_start_loc.dtype == torch.int32
