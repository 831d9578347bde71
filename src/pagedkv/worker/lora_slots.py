"""Writing a LoRA adapter into its blocks of the KV pool, and viewing it there.

The scheduler gave the adapter a run of consecutive blocks (`memory/adapters.py`); here its
matrices are copied, once, into each layer's K and V chunks of that run, where `place` says,
and the model gets views of them (`model/lora.py`'s `AdapterWeights`). Evicting it only drops
the views: the blocks are already back in the pool, and KV overwrites them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pagedkv.kvmath.lora import Placement, place
from pagedkv.memory.adapters import ResidentAdapter
from pagedkv.model.decoder import DecoderModel
from pagedkv.model.lora import AdapterWeights, LoRAPart, ProjectionLoRA, lora_slices
from pagedkv.weights.lora import LoRAAdapter, layer_sizes
from pagedkv.worker.kv_cache import KVCache


def load_adapters(
    loaded: list[ResidentAdapter],
    model: DecoderModel,
    kv_cache: KVCache,
    registry: Mapping[int, LoRAAdapter],
) -> None:
    """Write the adapters given blocks into them, each cut to this rank's share (whole in one
    process), and hand the model their views."""
    slices = lora_slices(model)
    for resident in loaded:
        model.lora_adapters[resident.lora_id] = write_adapter(
            registry[resident.lora_id].shard(slices), resident, kv_cache, model.config.num_layers
        )


@torch.no_grad()
def write_adapter(
    adapter: LoRAAdapter, resident: ResidentAdapter, kv_cache: KVCache, num_layers: int
) -> AdapterWeights:
    """Copy `adapter`'s matrices into `resident`'s blocks; views of them, by projection. Each
    projection's A matrices are stacked; each B is kept transposed, `[rank, out]`
    (`model/lora.py` multiplies by its rows)."""
    layers = adapter.layer_projections(num_layers)
    placements = place(layer_sizes(layers), resident.num_blocks, kv_cache.adapter_chunk_elements)
    projections = {}
    for layer, (adapted, where) in enumerate(zip(layers, placements, strict=True)):
        regions = [
            kv_cache.adapter_region(layer, region, resident.first_block, resident.num_blocks)
            for region in (0, 1)
        ]
        spots = iter(where)
        for projection in adapted:
            a = _written(projection.a, regions, next(spots))
            parts, rank_offset = [], 0
            for index, module in projection.present:
                b_t = _written(module.b.T.contiguous(), regions, next(spots))
                parts.append(LoRAPart(index, rank_offset, b_t, module.scaling))
                rank_offset += module.rank
            projections[(layer, projection.parts)] = ProjectionLoRA(a, parts)
    return AdapterWeights(projections, num_layers)


def _written(matrix: torch.Tensor, regions: list[torch.Tensor], spot: Placement) -> torch.Tensor:
    """`matrix` copied to its spot (`place`'s) of a layer's regions; the view of it there."""
    region, offset = spot
    view = regions[region][offset : offset + matrix.numel()].view(matrix.shape)
    return view.copy_(matrix)
