"""Capacity planning: how long one request can be and how many fit at once, per GPU pool.

The pool is either given (`--pool-gb`) or worked out the way a server sizes it:
`memory x utilization - weights - activation reserve`. Concurrency for a request length
counts whole paged blocks, because that is what a paged server hands out; the
slab-versus-paged comparison puts a server reserving `max_model_len` per request beside one
holding only the blocks an average request fills. `pool_blocks` and `max_concurrency` are also
what the engine's start-up line prints (`worker/kv_budget.py`), so `pagedkv plan` and a
running engine given the same pool bytes and KV dtype state the same two numbers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from pagedkv.kvmath.spec import GB, ConfigError, KVSpec, format_bytes


class PlanError(ConfigError):
    """A plan that cannot exist: a pool with no room for KV cache or for one block, a zero
    length."""


@dataclass(frozen=True)
class PoolBudget:
    """The bytes left for KV cache and, when sized from a GPU, each term that produced them."""

    pool_bytes: int
    gpu: str | None = None
    memory_bytes: int | None = None
    utilization: float | None = None
    weight_bytes: int | None = None
    activation_bytes: int | None = None

    @classmethod
    def given(cls, pool_bytes: int) -> PoolBudget:
        """A pool stated directly (`--pool-gb`)."""
        if pool_bytes <= 0:
            raise PlanError(f"KV pool must be positive, got {pool_bytes:,} bytes")
        return cls(pool_bytes=pool_bytes)

    @classmethod
    def from_gpu(
        cls,
        gpu: str,
        memory_bytes: int,
        utilization: float,
        weight_bytes: int,
        activation_bytes: int,
    ) -> PoolBudget:
        """`memory x utilization - weights - activation reserve`, refusing a pool of <= 0."""
        if not 0 < utilization <= 1:
            raise PlanError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
        usable = int(memory_bytes * utilization)
        pool = usable - weight_bytes - activation_bytes
        if pool <= 0:
            remedy = (
                "--tensor-parallel-size splits the weights over several GPUs"
                if weight_bytes >= usable
                else "a smaller --activation-gb or a larger --gpu-memory-utilization leaves room"
            )
            raise PlanError(
                f"no room for KV cache on {gpu}: {usable / GB:,.2f} GB usable, weights "
                f"{weight_bytes / GB:,.2f} GB, activation reserve {activation_bytes / GB:,.2f} GB; "
                f"{remedy}"
            )
        return cls(pool, gpu, memory_bytes, utilization, weight_bytes, activation_bytes)


@dataclass(frozen=True)
class LengthRow:
    """One request length: what a request of it holds and how many fit in the pool."""

    request_tokens: int
    tokens_held: int
    bytes_per_request: int
    blocks_per_request: int
    max_concurrency: int
    beyond_context: bool


@dataclass(frozen=True)
class SlabVersusPaged:
    """Requests of `avg_tokens` under slab reservation at `max_model_len` and under paging."""

    avg_tokens: int
    max_model_len: int
    slab_tokens_per_request: int
    slab_concurrency: int
    paged_blocks_per_request: int
    paged_concurrency: int

    @property
    def gain(self) -> float:
        """How many times more requests paging fits."""
        return self.paged_concurrency / self.slab_concurrency if self.slab_concurrency else math.inf


@dataclass(frozen=True)
class CapacityPlan:
    """Everything `pagedkv plan` prints."""

    spec: KVSpec
    block_size: int
    pool: PoolBudget
    pool_tokens: int
    pool_blocks: int
    context: int | None  # max_model_len served (None: the config names none)
    longest_request: int
    rows: list[LengthRow]
    comparison: SlabVersusPaged | None

    def to_dict(self) -> dict[str, object]:
        """The plan as JSON-ready values."""
        return {
            "spec": self.spec.to_dict(),
            "block_size": self.block_size,
            "pool": asdict(self.pool),
            "pool_tokens": self.pool_tokens,
            "pool_blocks": self.pool_blocks,
            "context": self.context,
            "longest_request": self.longest_request,
            "rows": [asdict(row) for row in self.rows],
            "comparison": asdict(self.comparison) if self.comparison else None,
        }


def plan_capacity(
    spec: KVSpec,
    pool: PoolBudget,
    lengths: list[int],
    block_size: int = 16,
    avg_tokens: int | None = None,
    max_model_len: int | None = None,
) -> CapacityPlan:
    """Per-length concurrency in `pool`, and slab-versus-paged when `avg_tokens` is given.

    `max_model_len` defaults to the model's context (a longer one is refused); the slab side of
    the comparison reserves that many tokens per request.
    """
    bytes_per_block = spec.bytes_per_block(block_size)
    pool_blocks = blocks_in_pool(spec, pool.pool_bytes, block_size)
    if pool_blocks == 0:
        raise PlanError(
            f"a KV pool of {format_bytes(pool.pool_bytes)} holds no block: one block of "
            f"{block_size:,} tokens is {format_bytes(bytes_per_block)}"
        )
    pool_tokens = pool.pool_bytes // spec.bytes_per_token
    context = spec.served_context(max_model_len)
    rows = [_length_row(spec, length, block_size, pool_blocks, context) for length in lengths]
    comparison = None
    if avg_tokens is not None:
        if context is None:
            raise PlanError("--avg-tokens needs --max-model-len: the config names no context")
        comparison = _slab_versus_paged(spec, pool, avg_tokens, context, block_size, pool_blocks)
    longest = _longest_request(context, block_size, pool_blocks)
    return CapacityPlan(
        spec, block_size, pool, pool_tokens, pool_blocks, context, longest, rows, comparison
    )


def blocks_in_pool(spec: KVSpec, pool_bytes: int, block_size: int) -> int:
    """Whole blocks of `block_size` tokens that `pool_bytes` hold."""
    return pool_bytes // spec.bytes_per_block(block_size)


def max_concurrency(spec: KVSpec, pool_blocks: int, request_tokens: int, block_size: int) -> int:
    """Requests of `request_tokens` tokens that `pool_blocks` blocks hold at once: each takes
    the whole blocks its tokens fill."""
    return pool_blocks // spec.blocks_per_request(request_tokens, block_size)


def _longest_request(context: int | None, block_size: int, pool_blocks: int) -> int:
    """The longest single request: the pool's tokens, or the context if that is shorter."""
    pool_tokens = pool_blocks * block_size
    return pool_tokens if context is None else min(pool_tokens, context)


def _length_row(
    spec: KVSpec, length: int, block_size: int, pool_blocks: int, context: int | None
) -> LengthRow:
    if length <= 0:
        raise PlanError(f"request length must be positive, got {length}")
    return LengthRow(
        request_tokens=length,
        tokens_held=spec.tokens_held(length),
        bytes_per_request=spec.bytes_per_request(length, block_size),
        blocks_per_request=spec.blocks_per_request(length, block_size),
        max_concurrency=max_concurrency(spec, pool_blocks, length, block_size),
        beyond_context=context is not None and length > context,
    )


def _slab_versus_paged(
    spec: KVSpec,
    pool: PoolBudget,
    avg_tokens: int,
    max_model_len: int,
    block_size: int,
    pool_blocks: int,
) -> SlabVersusPaged:
    if avg_tokens <= 0 or avg_tokens > max_model_len:
        raise PlanError(f"--avg-tokens must be in 1..{max_model_len:,}, got {avg_tokens:,}")
    # A slab is one contiguous reservation, so it is not rounded to blocks: the pool divides
    # straight into reservations of max_model_len tokens.
    slab_tokens = spec.tokens_held(max_model_len)
    paged_blocks = spec.blocks_per_request(avg_tokens, block_size)
    return SlabVersusPaged(
        avg_tokens=avg_tokens,
        max_model_len=max_model_len,
        slab_tokens_per_request=slab_tokens,
        slab_concurrency=pool.pool_bytes // (slab_tokens * spec.bytes_per_token),
        paged_blocks_per_request=paged_blocks,
        paged_concurrency=pool_blocks // paged_blocks,
    )
