"""HostTier: a second level of the prefix cache, in host RAM, for blocks the GPU pool evicts.

When the GPU pool reuses a free block that still holds computed, hashed KV, the KV would be
lost and the next prompt with that prefix recomputed. With a host tier, the block is first
copied to a host block (a `SWAP_OUT` move in the step's plan, ahead of anything that writes
the GPU block), keyed by the same chained hash, salt included, and the same token bytes; a
later prompt whose prefix misses on the GPU but hits here gets the block copied back (a
`SWAP_IN` move) instead of recomputed.

The tier has its own host blocks and its own LRU: it does not share the swap pool of
preemption. Swap space must be there when the scheduler preempts, or a swap would turn into
a recompute, and a prefix tier is only a cache; kept apart, each behaves as configured.
Host block ids follow the swap pool's (`first_id` on), so one CPU tensor holds both.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagedkv.memory.hashing import BlockHash


@dataclass(frozen=True)
class HostTierStats:
    """Blocks held now; lookups and hits (in blocks) since the tier was made."""

    num_blocks: int
    queries: int
    hits: int


class HostTier:
    """Host blocks keyed by chained block hash, least recently used evicted first."""

    def __init__(self, num_blocks: int, first_id: int = 0) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.first_id = first_id
        # hash -> (host block id, token bytes); the first entry is the least recently used.
        self._entries: OrderedDict[BlockHash, tuple[int, bytes]] = OrderedDict()
        self._free_ids = list(range(first_id + num_blocks - 1, first_id - 1, -1))
        self._queries = 0
        self._hits = 0
        self._recent_hits: set[int] = set()  # host ids copied back since last taken

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, block_hash: BlockHash, token_bytes: bytes) -> int | None:
        """The host block holding exactly these tokens after this prefix, if any; changes
        nothing (`take` the hits that are used). Token bytes guard against hash collisions."""
        entry = self._entries.get(block_hash)
        if entry is None or entry[1] != token_bytes:
            return None
        return entry[0]

    def take(self, hashes: list[BlockHash], num_queries: int) -> None:
        """Count `num_queries` lookups, and hits on `hashes`, now most recently used."""
        self._queries += num_queries
        self._hits += len(hashes)
        for block_hash in hashes:
            self._entries.move_to_end(block_hash)
            self._recent_hits.add(self._entries[block_hash][0])

    def held_ids(self) -> set[int]:
        """Host block ids holding an entry (for the page map)."""
        return {host_id for host_id, _ in self._entries.values()}

    def take_recent_hits(self) -> set[int]:
        """Host block ids copied back since this was last called (for the page map)."""
        hits, self._recent_hits = self._recent_hits, set()
        return hits

    def store(
        self, block_hash: BlockHash, token_bytes: bytes, keep: frozenset[int] = frozenset()
    ) -> int | None:
        """Make room for an evicted GPU block; the host id to copy it into, or None when the
        tier already holds this block (it is only marked used) or has no room.

        Host blocks in `keep` are not reused: the caller is about to copy them back, and a
        copy into them queued ahead of that would overwrite what it reads.
        """
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return None
        if self._free_ids:
            host_id = self._free_ids.pop()
        else:
            victim = next((h for h, (i, _) in self._entries.items() if i not in keep), None)
            if victim is None:
                return None
            host_id, _ = self._entries.pop(victim)
        self._entries[block_hash] = (host_id, token_bytes)
        return host_id

    def forget(self, host_ids: set[int]) -> None:
        """Drop the entries held in these host blocks (a save into them that a failed step
        never ran); their ids are free again. Ids not held here are ignored."""
        for block_hash, (host_id, _) in list(self._entries.items()):
            if host_id in host_ids:
                del self._entries[block_hash]
                self._free_ids.append(host_id)

    def clear(self) -> None:
        """Drop every entry; the lookup and hit counts go on."""
        self.forget({host_id for host_id, _ in self._entries.values()})

    @property
    def stats(self) -> HostTierStats:
        return HostTierStats(len(self._entries), self._queries, self._hits)

    def check_invariants(self) -> None:
        """Raise AssertionError unless held and free host ids partition the tier's ids."""
        held = [host_id for host_id, _ in self._entries.values()]
        ids = sorted(held + self._free_ids)
        if ids != list(range(self.first_id, self.first_id + self.num_blocks)):
            raise AssertionError(
                f"host tier: {len(held)} held + {len(self._free_ids)} free ids do not "
                f"partition its {self.num_blocks} blocks"
            )
