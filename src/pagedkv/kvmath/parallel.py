"""KV arithmetic under tensor parallelism: what one rank's cache holds.

Each rank's cache holds only its KV heads: `num_kv_heads / tp` of them, or, when there are
fewer KV heads than ranks (which must then be a multiple of them), one replicated head per
rank. So a rank's block is `1/tp` of a whole block's bytes, or one head's worth once the
heads run out; the pool has the same block ids on every rank, so the blocks a per-rank budget
holds are the logical pool's blocks. The planner counts those per-rank bytes (replicated heads
included), which is what each device must hold. (The engine builds its caches from the sharded
model itself; a test checks the two agree.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from pagedkv.kvmath.spec import ConfigError, KVSpec, text_config


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads one rank's cache holds; a `ConfigError` when they cannot be split."""
    if tensor_parallel_size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if num_kv_heads >= tensor_parallel_size:
        if num_kv_heads % tensor_parallel_size:
            raise ConfigError(
                f"{num_kv_heads} KV heads are not divisible by tensor_parallel_size "
                f"({tensor_parallel_size})"
            )
        return num_kv_heads // tensor_parallel_size
    if tensor_parallel_size % num_kv_heads:
        raise ConfigError(
            f"tensor_parallel_size ({tensor_parallel_size}) is not a multiple of the "
            f"{num_kv_heads} KV heads it would replicate"
        )
    return 1


def per_rank_spec(spec: KVSpec, tensor_parallel_size: int) -> KVSpec:
    """`spec` as one rank's cache sees it (an MLA latent is not split: every rank keeps it)."""
    if tensor_parallel_size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if spec.is_mla or tensor_parallel_size == 1:
        return spec
    return replace(spec, num_kv_heads=kv_heads_per_rank(spec.num_kv_heads, tensor_parallel_size))


def check_even_split(config: Mapping[str, object] | None, tensor_parallel_size: int) -> None:
    """The query heads and the MLP's channels must split evenly too, as the engine's splitter
    and vLLM require (a `ConfigError` otherwise); a config that does not say how many it has
    passes."""
    settings = {} if config is None else text_config(config)
    for key, what in (
        ("num_attention_heads", "attention heads"),
        ("intermediate_size", "MLP channels (intermediate_size)"),
    ):
        units = settings.get(key)
        if isinstance(units, int) and not isinstance(units, bool) and units % tensor_parallel_size:
            raise ConfigError(
                f"{units} {what} are not divisible by tensor_parallel_size "
                f"({tensor_parallel_size}): each rank takes an equal share"
            )
