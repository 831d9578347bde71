"""Which tensor-parallel rank the model being built belongs to.

Layers are sharded when they are constructed (so each rank allocates only its slice), and model
constructors are reached through the loaders, which know nothing of ranks. So, like
`torch.device(...)` for the device, the group is set around loading with `sharding(group)` and
read by each layer's constructor; a layer keeps what it read, so a model built outside the
context (a TP=1 engine beside a TP=2 one in the same process) stays whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class TPGroup:
    """This process's place among `size` tensor-parallel ranks."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")


SINGLE = TPGroup(rank=0, size=1)
_building: list[TPGroup] = []


@contextmanager
def sharding(group: TPGroup) -> Iterator[None]:
    """Layers constructed inside hold only `group.rank`'s shard of their weights."""
    _building.append(group)
    try:
        yield
    finally:
        _building.pop()


def building_group() -> TPGroup:
    """The group of the model under construction: `SINGLE` outside `sharding`."""
    return _building[-1] if _building else SINGLE
