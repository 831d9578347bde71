"""AdapterBlocks: LoRA adapters paged into the KV pool's own blocks (S-LoRA's unified pool).

An adapter's weights live in a run of consecutive blocks of the same pool as KV, taken when a
request needs the adapter and given back when it is evicted, so memory that holds no adapter
serves KV and the other way round. Per layer, a block is two chunks of the cache tensor (its
K and its V, `chunk_elements` float32 elements each: `worker/kv_cache.py` lays every layer's
blocks end to end), so a run of n blocks is, in every layer, two contiguous regions of
`n * chunk_elements` elements. `kvmath/lora.py`'s `place` packs each layer's adapter matrices
into them (first fit decreasing, a matrix never split), and the worker views them there: no
copy per step.

A resident adapter has a reference count: the requests admitted with it. One that no request
uses stays resident (a request for it later needs no load) until its blocks are wanted: for
another adapter, or for KV when the pool runs out (`evict_idle`), least recently used first.
At most `max_loras` are resident at once. Loads and evictions are recorded for the worker,
which writes an adapter's weights into its blocks before the step that first uses them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pagedkv.memory.pool import BlockPool


@dataclass
class ResidentAdapter:
    """An adapter's run of blocks and how many admitted requests use it."""

    lora_id: int
    first_block: int
    num_blocks: int
    ref_count: int = 0


@dataclass
class AdapterChanges:
    """What the worker must do before the next forward pass: forget the evicted adapters,
    then write the loaded ones into their blocks."""

    evicted: list[int] = field(default_factory=list)
    loaded: list[ResidentAdapter] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.evicted or self.loaded)


class AdapterBlocks:
    """The adapters resident in a `BlockPool`, their reference counts and their LRU order."""

    def __init__(self, pool: BlockPool, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.pool = pool
        self.max_loras = max_loras
        self.resident: OrderedDict[int, ResidentAdapter] = OrderedDict()  # LRU first
        self.changes = AdapterChanges()
        self.num_loads = 0
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        """Blocks the resident adapters hold."""
        return sum(adapter.num_blocks for adapter in self.resident.values())

    def acquire(self, lora_id: int, num_blocks: int) -> ResidentAdapter | None:
        """Take a reference on the adapter, loading it into a run of `num_blocks` free blocks
        if it is not resident (evicting idle adapters for the slot or the run); None when it
        cannot be loaded now (every slot busy, or no run free): the request waits."""
        adapter = self.resident.get(lora_id)
        if adapter is None:
            adapter = self._load(lora_id, num_blocks)
            if adapter is None:
                return None
        adapter.ref_count += 1
        self.resident.move_to_end(lora_id)
        return adapter

    def release(self, lora_id: int) -> None:
        """Drop a reference; the adapter stays resident, idle, until its blocks are wanted."""
        self.resident[lora_id].ref_count -= 1

    def evict_idle(self) -> bool:
        """Give the least recently used idle adapter's blocks back to the pool; False when
        every resident adapter is in use."""
        for lora_id, adapter in self.resident.items():
            if adapter.ref_count == 0:
                self._evict(lora_id)
                return True
        return False

    def evict(self, lora_id: int) -> None:
        """Give an idle adapter's blocks back now (its weights are being forgotten)."""
        if self.resident[lora_id].ref_count:
            raise ValueError(f"LoRA adapter {lora_id} is in use: it cannot be evicted")
        self._evict(lora_id)

    def retry(self, failed: AdapterChanges) -> None:
        """Hand a failed step's changes to the next step again, ahead of newer ones: the
        worker may never have run them. Forgetting again is harmless, and an adapter still
        resident is written again (one evicted since is not)."""
        loaded = [a for a in failed.loaded if self.resident.get(a.lora_id) is a]
        pending = {a.lora_id for a in self.changes.loaded}
        self.changes.evicted[:0] = failed.evicted
        self.changes.loaded[:0] = [a for a in loaded if a.lora_id not in pending]

    def take_changes(self) -> AdapterChanges:
        """The loads and evictions since the last call, for the worker."""
        changes, self.changes = self.changes, AdapterChanges()
        return changes

    def _load(self, lora_id: int, num_blocks: int) -> ResidentAdapter | None:
        if num_blocks > self.pool.num_blocks:
            raise ValueError(
                f"LoRA adapter {lora_id} needs {num_blocks} blocks, the pool has "
                f"{self.pool.num_blocks}"
            )
        while len(self.resident) >= self.max_loras:
            if not self.evict_idle():
                return None
        while (run := self.pool.take_run(num_blocks)) is None:
            if not self.evict_idle():
                return None
        adapter = ResidentAdapter(lora_id, run[0].block_id, num_blocks)
        self.resident[lora_id] = adapter
        self.changes.loaded.append(adapter)
        self.num_loads += 1
        return adapter

    def _evict(self, lora_id: int) -> None:
        adapter = self.resident.pop(lora_id)
        first = adapter.first_block
        self.pool.release_run(self.pool.blocks[first : first + adapter.num_blocks])
        self.changes.loaded = [a for a in self.changes.loaded if a.lora_id != lora_id]
        self.changes.evicted.append(lora_id)
        self.num_evictions += 1
