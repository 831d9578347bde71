"""LoRA adapters' share of the KV pool: how their matrices are packed into pool blocks, and
what `pagedkv plan --lora-rank R --max-loras N` states.

An adapter holds, per layer, A `[rank, in]` and B `[out, rank]` of any of q, k, v, o, gate, up
and down, in float32, the A matrices of one fused projection stacked (`matrix_sizes`). They
live in a run of pool blocks (`memory/adapters.py`): per layer, a block lends its K and its V
chunk, and `place` packs the layer's matrices into the run's two regions. An adapter takes
`blocks_needed` blocks: the engine's worker and the planner count them the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pagedkv.kvmath.spec import KVSpec

FLOAT32_BYTES = 4
# The projections LoRA adapts, as the model fuses them: an adapter's A matrices of one projection
# are stacked (`[sum of ranks, in]`, one matmul for all its parts), each part's B kept apart.
PROJECTIONS = (
    ("q_proj", "k_proj", "v_proj"),
    ("o_proj",),
    ("gate_proj", "up_proj"),
    ("down_proj",),
)
TARGETS = tuple(part for parts in PROJECTIONS for part in parts)  # q_proj .. down_proj
Placement = tuple[int, int]  # (region: 0 the K chunks, 1 the V chunks; offset in elements)


def projection_shapes(
    hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection LoRA may adapt."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


def matrix_sizes(projections: list[list[tuple[int, int, int]]]) -> list[int]:
    """The float32 element counts of one layer's matrices, in the order they are written: per
    adapted projection (its parts' `(in, out, rank)`), its stacked A, then each part's B."""
    sizes = []
    for parts in projections:
        sizes.append(sum(in_features * rank for in_features, _, rank in parts))
        sizes += [out_features * rank for _, out_features, rank in parts]
    return sizes


def place(
    layer_sizes: list[list[int]], num_blocks: int, chunk_elements: int
) -> list[list[Placement]]:
    """Where each layer's matrices (element counts) go in the two regions of a run of
    `num_blocks` blocks, in the order given; raises ValueError when they do not fit. Largest
    first, each into the first region with room (first fit decreasing)."""
    capacity = num_blocks * chunk_elements
    placements = []
    for layer, sizes in enumerate(layer_sizes):
        used = [0, 0]
        where: list[Placement] = [(0, 0)] * len(sizes)
        for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            size = sizes[index]
            region = next((r for r in (0, 1) if used[r] + size <= capacity), None)
            if region is None:
                raise ValueError(f"layer {layer}'s adapter matrices do not fit {num_blocks} blocks")
            where[index] = (region, used[region])
            used[region] += size
        placements.append(where)
    return placements


def blocks_needed(layer_sizes: list[list[int]], chunk_elements: int) -> int:
    """The fewest blocks whose regions hold every layer's matrices (`place` succeeds)."""
    largest = max((sum(sizes) for sizes in layer_sizes), default=0)
    num_blocks = max(1, -(-largest // (2 * chunk_elements)))
    while True:
        try:
            place(layer_sizes, num_blocks, chunk_elements)
            return num_blocks
        except ValueError:
            num_blocks += 1


@dataclass(frozen=True)
class LoRAPlan:
    """N adapters of one rank: bytes and pool blocks each, and all together."""

    rank: int
    max_loras: int
    bytes_per_adapter: int
    blocks_per_adapter: int
    block_bytes: int

    @property
    def blocks(self) -> int:
        return self.max_loras * self.blocks_per_adapter

    @property
    def pool_bytes(self) -> int:
        """Bytes of the pool N resident adapters hold (whole blocks)."""
        return self.blocks * self.block_bytes

    def to_dict(self) -> dict[str, int]:
        return {
            "lora_rank": self.rank,
            "max_loras": self.max_loras,
            "bytes_per_adapter": self.bytes_per_adapter,
            "blocks_per_adapter": self.blocks_per_adapter,
            "adapter_blocks": self.blocks,
            "adapter_pool_bytes": self.pool_bytes,
        }


def plan_lora(
    config: Mapping[str, object],
    spec: KVSpec,
    rank: int,
    max_loras: int,
    block_size: int,
    tensor_parallel_size: int = 1,
) -> LoRAPlan:
    """The pool share of `max_loras` adapters of `rank` on every projection of `config`'s
    model, in blocks of `block_size` tokens of `spec` (one rank's, under tensor parallelism:
    each rank holds its share of an adapter as of the base weights, its heads and MLP channels
    of B for q/k/v and gate/up, its input columns of A for o and down; `spec` is already the
    rank's)."""
    heads = int(config["num_attention_heads"])  # type: ignore[arg-type]
    hidden = int(config["hidden_size"])  # type: ignore[arg-type]
    shapes = projection_shapes(
        hidden,
        int(config["intermediate_size"]) // tensor_parallel_size,  # type: ignore[arg-type]
        heads // tensor_parallel_size,
        spec.num_kv_heads,
        spec.head_dim,
    )
    layer = matrix_sizes([[(*shapes[part], rank) for part in parts] for parts in PROJECTIONS])
    block_bytes = spec.bytes_per_block(block_size)
    chunk_elements = block_bytes // (2 * spec.num_layers) // FLOAT32_BYTES
    blocks = blocks_needed([layer] * spec.num_layers, chunk_elements)
    adapter_bytes = sum(layer) * spec.num_layers * FLOAT32_BYTES
    return LoRAPlan(rank, max_loras, adapter_bytes, blocks, block_bytes)
