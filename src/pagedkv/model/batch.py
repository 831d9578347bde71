"""ForwardBatch: the flat, unpadded metadata of one forward pass over many sequences.

The tokens of all sequences are laid end to end, whatever each sequence is doing: a whole
prompt, the uncached rest of a prompt after a prefix-cache hit, one chunk of a long prompt,
or one decode token. Per sequence, `num_computed` tokens already have K/V in the cache and
the new tokens follow them; the block table says where all of them live.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedkv.model.errors import InvalidBatch


@dataclass(frozen=True)
class SequenceInput:
    """One sequence's share of a forward pass.

    `token_ids` are the new tokens, at positions `num_computed ..`; `block_table` must cover
    all `num_computed + len(token_ids)` tokens.
    """

    token_ids: Sequence[int]
    num_computed: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class ForwardBatch:
    """Tensors the model and attention read; build it with `ForwardBatch.build`."""

    input_ids: Tensor  # [num_tokens] int64
    positions: Tensor  # [num_tokens] int64, absolute position of each token
    slot_mapping: Tensor  # [num_tokens] int64, flat cache slot each token's K/V goes to
    block_tables: Tensor  # [num_seqs, max_blocks] int32, rows padded with block 0
    context_lens: Tensor  # [num_seqs] int32, cached + new tokens
    query_lens: Tensor  # [num_seqs] int32, new tokens
    logits_indices: Tensor  # [num_seqs] int64, each sequence's last token in the flat batch

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the batch."""
        return self.query_lens.shape[0]

    @classmethod
    def build(
        cls,
        sequences: Sequence[SequenceInput],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Lay the sequences end to end and compute positions and cache slots."""
        if not sequences:
            raise InvalidBatch("a forward batch needs at least one sequence")
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        for index, seq in enumerate(sequences):
            _check(index, seq, block_size)
            for position in range(seq.num_computed, seq.num_computed + len(seq.token_ids)):
                block = seq.block_table[position // block_size]
                slot_mapping.append(block * block_size + position % block_size)
                positions.append(position)
            input_ids.extend(seq.token_ids)
        max_blocks = max(len(seq.block_table) for seq in sequences)
        block_tables = [
            list(seq.block_table) + [0] * (max_blocks - len(seq.block_table)) for seq in sequences
        ]
        query_lens = torch.tensor([len(seq.token_ids) for seq in sequences], dtype=torch.int32)

        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            input_ids=tensor(input_ids, torch.int64),
            positions=tensor(positions, torch.int64),
            slot_mapping=tensor(slot_mapping, torch.int64),
            block_tables=tensor(block_tables, torch.int32),
            context_lens=tensor(
                [s.num_computed + len(s.token_ids) for s in sequences], torch.int32
            ),
            query_lens=query_lens.to(device),
            logits_indices=(query_lens.cumsum(0) - 1).to(device=device, dtype=torch.int64),
        )


def _check(index: int, seq: SequenceInput, block_size: int) -> None:
    if not seq.token_ids:
        raise InvalidBatch(f"sequence {index} has no new tokens to compute")
    if seq.num_computed < 0:
        raise InvalidBatch(f"sequence {index} has num_computed {seq.num_computed} < 0")
    context_len = seq.num_computed + len(seq.token_ids)
    needed = -(-context_len // block_size)
    if len(seq.block_table) < needed:
        raise InvalidBatch(
            f"sequence {index} holds {context_len} tokens, which need {needed} blocks of "
            f"{block_size}, but its block table has {len(seq.block_table)}"
        )
