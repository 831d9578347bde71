"""ForwardBatch: the flat, unpadded metadata of one forward pass over many sequences.

The tokens of all sequences are laid end to end, whatever each sequence is doing: a whole
prompt, the uncached rest of a prompt after a prefix-cache hit, one chunk of a long prompt,
or one decode token. Per sequence, `num_computed` tokens already have K/V in the cache and
the new tokens follow them; the block table says where all of them live.

The batch keeps each sequence's lengths and token-id range as Python ints besides the device
tensors, so the model can validate inputs and attention can plan the step without reading
anything back from the device; what the attention backend plans from it is built on first use
and shared by every layer (`step_state`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from pagedkv.attention.errors import InvalidBatch, PositionOutOfRange, TokenIdOutOfRange

T = TypeVar("T")


@dataclass(frozen=True)
class SequenceInput:
    """One sequence's share of a forward pass.

    `token_ids` are the new tokens, at positions `num_computed ..`; `block_table` must cover
    all `num_computed + len(token_ids)` tokens. `num_logits` is how many of the new tokens,
    counted from the last, need logits: 1 for a chunk that samples, 0 for a prompt chunk that
    does not reach the prompt's end (the LM head is skipped for it: at a 151k vocabulary it
    is the largest matmul of a step), all of them to score every position (perplexity).
    `lora_id` names the LoRA adapter its rows go through (`model/lora.py`; 0: none).
    """

    token_ids: Sequence[int]
    num_computed: int
    block_table: Sequence[int]
    num_logits: int = 1
    lora_id: int = 0


@dataclass(frozen=True)
class ForwardBatch:
    """Tensors the model and attention read; build it with `ForwardBatch.build`."""

    input_ids: Tensor  # [num_tokens] int64
    positions: Tensor  # [num_tokens] int64, absolute position of each token
    slot_mapping: Tensor  # [num_tokens] int64, flat cache slot each token's K/V goes to
    block_tables: Tensor  # [num_seqs, max_blocks] int32, rows padded with block 0
    context_lens: Tensor  # [num_seqs] int32, cached + new tokens
    query_lens: Tensor  # [num_seqs] int32, new tokens
    logits_indices: Tensor  # [num_logits] int64, rows of the flat batch that need logits
    query_start_loc: Tensor  # [num_seqs + 1] int32, where each sequence's tokens start (GPU)
    block_size: int
    host_context_lens: tuple[int, ...]  # context_lens as Python ints
    host_query_lens: tuple[int, ...]  # query_lens as Python ints
    host_token_id_ranges: tuple[tuple[int, int], ...]  # (min, max) new token id per sequence
    # Per sequence, its rows of the logits the forward returns (`num_logits` of them).
    host_logits_rows: tuple[range, ...]
    # Per sequence, its LoRA adapter's id (0: none).
    host_lora_ids: tuple[int, ...] = ()
    # Per-step state of the attention backend (see `step_state`); not an init field, so
    # `replace` makes a batch that plans afresh.
    _step_state: dict[Hashable, Any] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the batch."""
        return len(self.host_query_lens)

    @classmethod
    def build(
        cls,
        sequences: Sequence[SequenceInput],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Lay the sequences end to end and compute positions and cache slots.

        Positions, slots and logits rows are Python lists, one tensor each: a list comprehension
        costs ~0.3 us a token, nothing beside a prompt token's share of the forward pass, while
        the ~15 numpy ops that computed them vectorised cost more than the lists at decode
        sizes (inside the engine's step, after the layers have left the cores' caches, 5-10 us
        each). Only the padded block tables go through numpy, whose nested-list conversion is
        the fastest.
        """
        if not sequences:
            raise InvalidBatch("a forward batch needs at least one sequence")
        for index, seq in enumerate(sequences):
            _check(index, seq, block_size)
        query_lens = [len(seq.token_ids) for seq in sequences]
        context_lens = [seq.num_computed + n for seq, n in zip(sequences, query_lens, strict=True)]
        spans = [
            range(seq.num_computed, end) for seq, end in zip(sequences, context_lens, strict=True)
        ]
        slots = [
            seq.block_table[position // block_size] * block_size + position % block_size
            for seq, span in zip(sequences, spans, strict=True)
            for position in span
        ]
        starts = list(accumulate(query_lens, initial=0))
        logits_rows = [
            row
            for seq, end in zip(sequences, starts[1:], strict=True)
            for row in range(end - seq.num_logits, end)
        ]
        max_blocks = max(len(seq.block_table) for seq in sequences)
        block_tables = np.array(
            [[*seq.block_table, *[0] * (max_blocks - len(seq.block_table))] for seq in sequences],
            dtype=np.int32,
        )

        def tensor(values: list[int], dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            input_ids=_token_tensor(sequences).to(device),
            positions=tensor(list(chain.from_iterable(spans)), torch.int64),
            slot_mapping=tensor(slots, torch.int64),
            block_tables=torch.from_numpy(block_tables).to(device),
            context_lens=tensor(context_lens, torch.int32),
            query_lens=tensor(query_lens, torch.int32),
            logits_indices=tensor(logits_rows, torch.int64),
            query_start_loc=tensor(starts, torch.int32),
            block_size=block_size,
            host_context_lens=tuple(context_lens),
            host_query_lens=tuple(query_lens),
            host_token_id_ranges=tuple(
                (min(seq.token_ids), max(seq.token_ids)) for seq in sequences
            ),
            host_logits_rows=_logits_rows(sequences),
            host_lora_ids=tuple(seq.lora_id for seq in sequences),
        )

    def check_inputs(self, vocab_size: int, max_positions: int) -> None:
        """Reject token ids outside `[0, vocab_size)` and positions past `max_positions`.

        Runs on the host copies, before the embedding: an out-of-range id would otherwise be
        an IndexError on the CPU and a device-side assert (a dead context) on a GPU.
        """
        for index, (low, high) in enumerate(self.host_token_id_ranges):
            if low < 0 or high >= vocab_size:
                raise TokenIdOutOfRange(index, low if low < 0 else high, vocab_size)
        for index, context_len in enumerate(self.host_context_lens):
            if context_len > max_positions:
                raise PositionOutOfRange(index, context_len, max_positions)

    def step_state(self, key: Hashable, build: Callable[[], T]) -> T:
        """What the attention backend derives from this batch once per forward, under `key`.

        Built by the first layer that asks and shared by every later layer of the same pass
        (the PyTorch backend keeps its step plan here).
        """
        if key not in self._step_state:
            self._step_state[key] = build()
        return self._step_state[key]


def _logits_rows(sequences: Sequence[SequenceInput]) -> tuple[range, ...]:
    """Each sequence's rows of the logits tensor: its `num_logits` rows, in sequence order."""
    ends = accumulate(seq.num_logits for seq in sequences)
    return tuple(range(end - seq.num_logits, end) for seq, end in zip(sequences, ends, strict=True))


def _token_tensor(sequences: Sequence[SequenceInput]) -> Tensor:
    try:
        return torch.tensor(
            list(chain.from_iterable(seq.token_ids for seq in sequences)), dtype=torch.int64
        )
    except (TypeError, ValueError, RuntimeError, OverflowError) as error:
        raise InvalidBatch(f"token ids must be 64-bit integers: {error}") from None


def _check(index: int, seq: SequenceInput, block_size: int) -> None:
    if not seq.token_ids:
        raise InvalidBatch(f"sequence {index} has no new tokens to compute")
    if seq.num_computed < 0:
        raise InvalidBatch(f"sequence {index} has num_computed {seq.num_computed} < 0")
    if not 0 <= seq.num_logits <= len(seq.token_ids):
        raise InvalidBatch(
            f"sequence {index} asks logits of {seq.num_logits} of its "
            f"{len(seq.token_ids)} new tokens"
        )
    context_len = seq.num_computed + len(seq.token_ids)
    needed = -(-context_len // block_size)
    if len(seq.block_table) < needed:
        raise InvalidBatch(
            f"sequence {index} holds {context_len} tokens, which need {needed} blocks of "
            f"{block_size}, but its block table has {len(seq.block_table)}"
        )
