"""How one dimension of a weight splits across tensor-parallel ranks (Megatron-style).

A dimension is a number of units (attention heads, MLP channels, vocabulary rows) of equal
size; each rank keeps a contiguous run of them. Heads must divide evenly, as vLLM requires
(`num_attention_heads % tensor_parallel_size == 0`); KV heads fewer than the ranks are
replicated instead: each rank keeps one, rank `r` the head `r // (size // num_kv_heads)`, so
its query heads (a contiguous run) all read that head. A vocabulary is padded: every rank keeps
`ceil(units / size)` rows, the last ones past the vocabulary are zeros and cut after the gather.
"""

from __future__ import annotations

from dataclasses import dataclass


class NotDivisible(ValueError):
    """A dimension cannot be split evenly across the tensor-parallel ranks."""


@dataclass(frozen=True)
class Split:
    """The run of units one rank keeps: `first` and `count` of the whole dimension's units, in
    a local dimension of `local` units (`local > count` only for a padded split)."""

    first: int
    count: int
    local: int


def split_even(num_units: int, rank: int, size: int, what: str) -> Split:
    """Rank `rank`'s equal share of `num_units`; `NotDivisible` otherwise, naming the units
    (`what`: "heads of q_proj")."""
    if num_units % size:
        raise NotDivisible(
            f"{num_units} {what} are not divisible by tensor_parallel_size ({size}): each rank "
            "takes an equal share, as vLLM's tensor parallelism requires"
        )
    per_rank = num_units // size
    return Split(rank * per_rank, per_rank, per_rank)


def split_or_replicate(num_units: int, rank: int, size: int, what: str) -> Split:
    """An even split, or (fewer units than ranks, dividing them) one replicated unit each."""
    if num_units >= size or size % num_units:
        return split_even(num_units, rank, size, what)
    return Split(rank // (size // num_units), 1, 1)


def split_padded(num_units: int, rank: int, size: int) -> Split:
    """`ceil(num_units / size)` units per rank, the last rank's run cut at `num_units`."""
    per_rank = -(-num_units // size)
    first = min(rank * per_rank, num_units)
    return Split(first, min(per_rank, num_units - first), per_rank)
