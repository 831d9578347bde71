"""ForwardBatch lays mixed sequences end to end with the right positions and cache slots."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.attention.errors import InvalidBatch, PositionOutOfRange, TokenIdOutOfRange
from pagedkv.worker.kv_cache import KVCache


def test_mixed_prefill_cached_prefix_and_decode():
    block_size = 4
    batch = ForwardBatch.build(
        [
            SequenceInput([10, 11, 12], num_computed=0, block_table=[5]),  # fresh prompt
            SequenceInput([20, 21, 22], num_computed=4, block_table=[0, 3]),  # after a prefix hit
            SequenceInput([30], num_computed=6, block_table=[1, 7]),  # one decode token
        ],
        block_size,
    )
    assert batch.input_ids.tolist() == [10, 11, 12, 20, 21, 22, 30]
    assert batch.positions.tolist() == [0, 1, 2, 4, 5, 6, 6]
    # slot = block_table[p // 4] * 4 + p % 4
    assert batch.slot_mapping.tolist() == [20, 21, 22, 12, 13, 14, 30]
    assert batch.block_tables.tolist() == [[5, 0], [0, 3], [1, 7]]  # padded with block 0
    assert batch.context_lens.tolist() == [3, 7, 7]
    assert batch.query_lens.tolist() == [3, 3, 1]
    assert batch.logits_indices.tolist() == [2, 5, 6]
    assert batch.num_seqs == 3
    # Python copies, so nothing per step has to read lengths back from the device.
    assert (batch.host_context_lens, batch.host_query_lens) == ((3, 7, 7), (3, 3, 1))
    assert batch.host_token_id_ranges == ((10, 12), (20, 22), (30, 30))
    assert (batch.input_ids.dtype, batch.slot_mapping.dtype) == (torch.int64, torch.int64)
    assert batch.block_tables.dtype == torch.int32


def test_a_prompt_chunk_starts_mid_block():
    batch = ForwardBatch.build([SequenceInput([1] * 5, 3, [9, 2])], block_size=4)
    assert batch.positions.tolist() == [3, 4, 5, 6, 7]
    assert batch.slot_mapping.tolist() == [39, 8, 9, 10, 11]


@pytest.mark.parametrize(
    ("sequences", "message"),
    [
        ([], "at least one sequence"),
        ([SequenceInput([], 3, [0])], "sequence 0 has no new tokens"),
        ([SequenceInput([1], -1, [0])], "num_computed -1"),
        (
            [SequenceInput([1], 0, [0]), SequenceInput([1, 2], 3, [4])],
            "sequence 1 holds 5 tokens, which need 2 blocks of 4, but its block table has 1",
        ),
    ],
)
def test_inconsistent_sequences_are_rejected(sequences, message):
    with pytest.raises(InvalidBatch, match=message):
        ForwardBatch.build(sequences, block_size=4)


def test_token_ids_that_do_not_fit_int64_are_rejected():
    with pytest.raises(InvalidBatch, match="64-bit integers"):
        ForwardBatch.build([SequenceInput([2**70], 0, [0])], block_size=4)


@pytest.mark.parametrize(
    ("token_ids", "num_computed", "error", "message"),
    [
        ([3, 320], 0, TokenIdOutOfRange, r"sequence 1 has token id 320, outside \[0, 320\)"),
        ([-1, 5], 0, TokenIdOutOfRange, r"sequence 1 has token id -1"),
        (
            [5],
            1024,
            PositionOutOfRange,
            "sequence 1 reaches position 1024, but the model allows 1024 positions",
        ),
    ],
)
def test_model_rejects_token_ids_and_positions_before_the_embedding(
    zoo, token_ids, num_computed, error, message
):
    model = zoo.ours("llama")  # vocab_size 320, max_position_embeddings 1024
    cache = KVCache.for_model(model.config, block_size=16, num_blocks=70)
    batch = ForwardBatch.build(
        [SequenceInput([3], 0, [0]), SequenceInput(token_ids, num_computed, list(range(1, 66)))],
        block_size=16,
    )
    with pytest.raises(error, match=message):
        model(batch, cache)
