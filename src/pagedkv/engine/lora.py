"""LoRARequest, vLLM's, and the catalog of adapters the engine's requests have named.

`LoRARequest(lora_name, lora_int_id, lora_path)` names an adapter: a PEFT folder, known to the
engine by its id from then on. The catalog reads a folder the first time its id is used (so a
missing, malformed or mismatched adapter is refused when the request is added, naming it,
and nothing in flight is touched), keeps the weights on the host for the worker to write into
pool blocks when a request needs them, and says how many blocks that takes
(`memory/adapters.py`). An id means the same adapter while the catalog holds it: reusing it
for another name or path is refused, as vLLM refuses it.

The host copies are bounded as vLLM bounds them: at most `max_cpu_loras` adapters (default
`max_loras`) are kept, the least recently named idle one forgotten first (with its pool
blocks); an adapter a request still uses is never forgotten, so the bound may be passed while
more are in use. `forget` (the engine's `remove_lora`, the server's unload) drops one as soon
as no request uses it; a later request naming it reads it again.

Prefix caching is keyed by adapter: a request's cache salt carries its adapter's id, name and
folder, so two adapters never share KV blocks, whatever the prompt (an id given again to
another adapter after the catalog forgot it included).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.errors import RequestRejected
from pagedkv.engine.lora_request import LoRARequest
from pagedkv.kvmath.lora import blocks_needed
from pagedkv.memory.adapters import AdapterBlocks
from pagedkv.model.config import ModelConfig
from pagedkv.model.lora import RankSlice
from pagedkv.weights.lora import AdapterError, LoRAAdapter, layer_sizes, read_adapter


class LoRARejected(RequestRejected):
    """A LoRA request the engine cannot serve; the message names the adapter and why."""


class LoRACatalog:
    """The adapters named so far, by id, read and checked once; `registry` is the worker's
    view of them (what a load writes into pool blocks)."""

    def __init__(
        self,
        config: ModelConfig,
        args: EngineArgs,
        chunk_elements: int,
        slices: Mapping[tuple[int, str], RankSlice],
        num_gpu_blocks: int,
        registry: dict[int, LoRAAdapter],
        resident: AdapterBlocks | None,
        in_use: Callable[[], set[int]],
    ) -> None:
        self.config = config
        self.num_gpu_blocks = num_gpu_blocks
        self.enabled = args.enable_lora
        self.max_lora_rank = args.max_lora_rank
        self.chunk_elements = chunk_elements
        self.slices = slices  # this rank's share of each adapted part (tensor parallelism)
        self.per_rank = " on each rank" if args.tensor_parallel_size > 1 else ""
        self.registry = registry
        self.resident = resident
        self.in_use = in_use  # the adapters of unfinished requests (0: none), never forgotten
        self.max_cpu_loras = args.max_cpu_loras or args.max_loras
        self.requests: dict[int, LoRARequest] = {}  # least recently named first
        self.num_blocks: dict[int, int] = {}
        self._unwanted: set[int] = set()  # forgotten once no request uses them

    def resolve(self, lora: LoRARequest | None) -> tuple[int, int]:
        """The adapter's id and the pool blocks it takes, reading it on first use (and
        forgetting an idle one if that passes the bound); (0, 0) for a request without one."""
        if lora is None:
            return 0, 0
        if not isinstance(lora, LoRARequest):
            raise LoRARejected(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        if not self.enabled:
            raise LoRARejected(
                f"LoRA adapter {lora.lora_name!r} asked of an engine started without "
                "enable_lora=True (--enable-lora)"
            )
        lora_id = lora.lora_int_id
        if not isinstance(lora_id, int) or isinstance(lora_id, bool) or lora_id < 1:
            raise LoRARejected(
                f"LoRA adapter {lora.lora_name!r}: lora_int_id must be an integer >= 1, "
                f"got {lora_id!r}"
            )
        known = self.requests.get(lora_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (lora.lora_name, lora.lora_path):
                raise LoRARejected(
                    f"LoRA id {lora_id} is adapter {known.lora_name!r} ({known.lora_path}), "
                    f"not {lora.lora_name!r} ({lora.lora_path}): one id, one adapter"
                )
            self.requests[lora_id] = self.requests.pop(lora_id)  # the most recently named
            self._unwanted.discard(lora_id)
            return lora_id, self.num_blocks[lora_id]
        try:
            adapter = read_adapter(lora.lora_path, lora.lora_name, self.config, self.max_lora_rank)
        except AdapterError as error:
            raise LoRARejected(str(error)) from None
        share = adapter.shard(self.slices)  # as this rank writes it; every rank's is as big
        sizes = layer_sizes(share.layer_projections(self.config.num_layers))
        num_blocks = blocks_needed(sizes, self.chunk_elements)
        if num_blocks >= self.num_gpu_blocks:
            raise LoRARejected(
                f"LoRA adapter {lora.lora_name!r} takes {num_blocks} KV blocks{self.per_rank}, "
                f"the whole pool has {self.num_gpu_blocks}: no room for a request beside it"
            )
        self.requests[lora_id] = lora
        self.num_blocks[lora_id] = num_blocks
        self.registry[lora_id] = adapter
        self.trim(keep=lora_id)
        return lora_id, self.num_blocks[lora_id]

    def forget(self, lora_id: int) -> bool:
        """Drop the adapter now, or once no request uses it; False if the catalog does not
        hold it."""
        if lora_id not in self.requests:
            return False
        self._unwanted.add(lora_id)
        self.trim()
        return True

    def trim(self, keep: int = 0) -> None:
        """Forget every unwanted adapter no request uses, then the least recently named idle
        ones (never `keep`, just named) while more than `max_cpu_loras` are held."""
        if not self._unwanted and len(self.requests) <= self.max_cpu_loras:
            return
        in_use = self.in_use() | {keep}
        for lora_id in [i for i in self._unwanted if i not in in_use]:
            self._drop(lora_id)
        idle = [lora_id for lora_id in self.requests if lora_id not in in_use]
        for lora_id in idle[: max(0, len(self.requests) - self.max_cpu_loras)]:
            self._drop(lora_id)

    def _drop(self, lora_id: int) -> None:
        """Forget an adapter no request uses: its host weights, and its pool blocks if it is
        resident (idle, so the worker is told to let it go before the next step)."""
        if self.resident is not None and lora_id in self.resident.resident:
            self.resident.evict(lora_id)
        del self.requests[lora_id], self.num_blocks[lora_id], self.registry[lora_id]
        self._unwanted.discard(lora_id)

    def runs(self, adapters: AdapterBlocks | None) -> list[tuple[int, int, str]]:
        """The resident adapters' runs of blocks, `(first block, blocks, name)`."""
        resident = () if adapters is None else adapters.resident.values()
        return [(a.first_block, a.num_blocks, self.requests[a.lora_id].lora_name) for a in resident]


def lora_cache_salt(cache_salt: str | None, lora: LoRARequest | None) -> str | None:
    """The prefix-cache salt of a request with adapter `lora` (None: none): its own salt and
    the adapter's id, name and folder, encoded as a list so that no salt a caller chooses can
    name another's (KV computed through one adapter never serves another, or the base model,
    even under an id the catalog has forgotten and a caller gave again to another adapter);
    None, the shared root, for a request with neither."""
    if lora is None:
        return None if cache_salt is None else json.dumps([cache_salt, 0])
    return json.dumps([cache_salt, lora.lora_int_id, lora.lora_name, lora.lora_path])
