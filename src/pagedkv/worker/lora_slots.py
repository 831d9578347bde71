"""Writing a LoRA adapter into its blocks of the KV pool, and viewing it there.

The scheduler gave the adapter a run of consecutive blocks (`memory/adapters.py`); here its
matrices are copied, once, into each layer's K and V chunks of that run, where `place` says,
and the model gets views of them (`model/lora.py`'s `AdapterWeights`). Evicting it only drops
the views: the blocks are already back in the pool, and KV overwrites them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pagedkv.kvmath.lora import place
from pagedkv.memory.adapters import ResidentAdapter
from pagedkv.model.decoder import DecoderModel
from pagedkv.model.lora import AdapterWeights
from pagedkv.weights.lora import LoRAAdapter
from pagedkv.worker.kv_cache import KVCache


def load_adapters(
    loaded: list[ResidentAdapter],
    model: DecoderModel,
    kv_cache: KVCache,
    registry: Mapping[int, LoRAAdapter],
) -> None:
    """Write the adapters given blocks into them and hand the model their views."""
    for resident in loaded:
        model.lora_adapters[resident.lora_id] = write_adapter(
            registry[resident.lora_id], resident, kv_cache, model.config.num_layers
        )


@torch.no_grad()
def write_adapter(
    adapter: LoRAAdapter, resident: ResidentAdapter, kv_cache: KVCache, num_layers: int
) -> AdapterWeights:
    """Copy `adapter`'s matrices into `resident`'s blocks; views of them, by module."""
    layers = adapter.layer_modules(num_layers)
    placements = place(
        adapter.layer_sizes(num_layers), resident.num_blocks, kv_cache.adapter_chunk_elements
    )
    modules = {}
    for layer, (targets, where) in enumerate(zip(layers, placements, strict=True)):
        regions = [
            kv_cache.adapter_region(layer, region, resident.first_block, resident.num_blocks)
            for region in (0, 1)
        ]
        for index, (target, module) in enumerate(targets):
            views = []
            for matrix, (region, offset) in zip(
                (module.a, module.b), where[2 * index : 2 * index + 2], strict=True
            ):
                view = regions[region][offset : offset + matrix.numel()].view(matrix.shape)
                view.copy_(matrix)
                views.append(view)
            modules[(layer, target)] = (views[0], views[1], module.scaling)
    return AdapterWeights(modules)
