"""KVCache: the key/value tensors of every layer, and the ops that execute memory plans.

The memory manager (`pagedkv.memory`) decides which block ids hold what; this class owns the
bytes. All layers' K and V live in one tensor `[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]`, so a copy-on-write or a swap of a block moves it in every layer with
one indexing op. A CPU-side swap space receives swapped-out blocks; it is block-major
(`[num_cpu_blocks, num_layers, 2, ...]`) so that consecutive CPU blocks are one contiguous
range a swap copies in one go.

K/V are stored in the model's dtype, or in one byte per value when `kv_cache_dtype` is fp8
(`attention/fp8.py`: the model computes in its dtype, every attention path converts on write
and read, and the pool holds twice the blocks of a 16-bit one). An fp8 pool and its swap space
are `torch.uint8`, viewed as the fp8 dtype per layer: copy-on-write and swaps index bytes,
which every indexing op takes, and move them exactly as they are.

The pool is allocated, never filled: `torch.empty` of a large tensor maps pages that the
operating system (or the GPU allocator) backs only when a block is first written, so a 4 GiB
pool costs nothing at start and memory grows with the blocks actually used. Never-written slots
therefore hold whatever the memory held, NaN included; every attention path reads only slots
below each sequence's length, or masks the rest out of both the scores and the values
(tests/engine/test_uninitialised_pool.py fills the pool with NaN, and an fp8 pool with NaN
bytes, and checks outputs).

A step's `MemoryPlan` runs as a whole through `execute`, in the order the memory manager
produced it, before the next forward pass: a block that a swap-out releases can be the
destination of a copy-on-write or a swap-in later in the same step, so running that later
move first would overwrite KV before it is saved.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from pagedkv.attention.errors import KVCacheDtypeMismatch
from pagedkv.attention.fp8 import FP8_DTYPES, UNIT_SCALES, KVScales, is_fp8
from pagedkv.kvmath.spec import KV_CACHE_DTYPES, KVSpec
from pagedkv.memory.moves import MemoryPlan, MoveKind
from pagedkv.model.config import ModelConfig
from pagedkv.model.decoder import DecoderModel
from pagedkv.worker.errors import KVCacheTooSmall

# KVSpec's names for the dtypes a cache stores (the bytes per value come from there).
_KV_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}
# A swap packs its blocks in device scratch memory first; capping a copy's length bounds that
# scratch, which matters because swapping happens when device memory is scarce.
MAX_BLOCKS_PER_SWAP_COPY = 64


class KVCache:
    """Paged K/V storage on the model's device plus a CPU swap space of the same block shape.

    `dtype` is what K/V are stored as: the model's dtype, or an fp8 dtype (with one `KVScales`
    per layer).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_cpu_blocks: int = 0,
        scales: Sequence[KVScales] | None = None,
    ) -> None:
        if dtype not in _KV_DTYPE_NAMES:
            raise ValueError(f"a KV cache stores one of {list(_KV_DTYPE_NAMES)}, not {dtype}")
        scales = tuple(scales) if scales is not None else (UNIT_SCALES,) * num_layers
        if len(scales) != num_layers:
            raise ValueError(f"{len(scales)} KV scales given for {num_layers} layers")
        device = torch.device(device)
        block_shape = (block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self._scales = scales
        self._dtype = dtype
        storage = torch.uint8 if is_fp8(dtype) else dtype
        self.cache = torch.empty(
            num_layers, 2, num_blocks, *block_shape, dtype=storage, device=device
        )
        # Block-major, so one CPU block (all layers, K and V) is contiguous and a run of
        # consecutive CPU blocks is one contiguous range that a swap copies in one go. Pinned
        # host memory lets swaps overlap with compute on a GPU; plain memory otherwise. A CPU
        # block is read only after a swap-out wrote it.
        self.swap_space = torch.empty(
            num_cpu_blocks,
            num_layers,
            2,
            *block_shape,
            dtype=storage,
            device="cpu",
            pin_memory=device.type == "cuda",
        )

    @classmethod
    def for_model(
        cls,
        model: DecoderModel | ModelConfig,
        *,
        block_size: int,
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        num_cpu_blocks: int = 0,
        cpu_memory_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        scales: Sequence[KVScales] | None = None,
    ) -> KVCache:
        """A cache shaped for `model`, sized by `num_blocks` or by a byte budget (not both).

        Given the model, the cache takes its device and, unless `dtype` is an fp8 dtype, its
        dtype: K/V are computed in the model's dtype, so another 16- or 32-bit `dtype` is a
        `KVCacheDtypeMismatch` now rather than a failed write later. Given only a config,
        float32 on the CPU unless told otherwise. `cpu_memory_bytes`, when given, sizes the
        swap space instead of `num_cpu_blocks`. `scales` (one per layer, default 1.0 as in
        vLLM; `attention/fp8.py` says why) say what an fp8 cache's bytes are worth.
        """
        if (num_blocks is None) == (memory_bytes is None):
            raise ValueError("give exactly one of num_blocks and memory_bytes")
        if isinstance(model, ModelConfig):
            config, model_dtype, model_device = model, torch.float32, torch.device("cpu")
        else:
            config, model_dtype, model_device = model.config, model.dtype, model.device
            if dtype is not None and dtype != model_dtype and not is_fp8(dtype):
                raise KVCacheDtypeMismatch(model_dtype, dtype)
        dtype = model_dtype if dtype is None else dtype
        device = model_device if device is None else device
        spec = kv_spec(model, dtype)
        per_block = spec.bytes_per_block(block_size)
        if memory_bytes is not None:
            num_blocks = memory_bytes // per_block
            if num_blocks == 0:
                raise KVCacheTooSmall(memory_bytes, per_block)
        if cpu_memory_bytes is not None:
            num_cpu_blocks = cpu_memory_bytes // per_block
        return cls(
            num_layers=config.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=spec.num_kv_heads,
            head_dim=config.head_dim,
            dtype=dtype,
            device=device,
            num_cpu_blocks=num_cpu_blocks,
            scales=scales,
        )

    @property
    def num_blocks(self) -> int:
        """Blocks on the model's device (the memory manager's `num_gpu_blocks`)."""
        return self.cache.shape[2]

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks in the CPU swap space."""
        return self.swap_space.shape[0]

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        """Views `(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads, head_dim]`
        of `dtype` (an fp8 pool's bytes viewed as its fp8 dtype)."""
        return self.cache[index, 0].view(self._dtype), self.cache[index, 1].view(self._dtype)

    @property
    def adapter_chunk_elements(self) -> int:
        """float32 elements in one block's K (or V) chunk of one layer: the unit a LoRA
        adapter's matrices are packed in (`memory/adapters.py`)."""
        return self.cache[0, 0, 0].numel() * self.cache.element_size() // 4

    def adapter_region(self, layer: int, region: int, first_block: int, num_blocks: int) -> Tensor:
        """Layer `layer`'s K (region 0) or V (region 1) chunks of blocks `first_block ..
        first_block + num_blocks - 1`, consecutive in memory, as one flat float32 tensor: where
        a LoRA adapter's matrices of that layer live while it is resident."""
        chunks = self.cache[layer, region, first_block : first_block + num_blocks]
        return chunks.reshape(-1).view(torch.uint8).view(torch.float32)

    def layer_scales(self, index: int) -> KVScales:
        """What layer `index`'s fp8 key and value bytes are worth (unused by other caches)."""
        return self._scales[index]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype K/V are stored as: the model's, or an fp8 dtype."""
        return self._dtype

    def check_dtype(self, kv_dtype: torch.dtype) -> None:
        """Raise `KVCacheDtypeMismatch` unless K/V of `kv_dtype` can be written here: the cache
        stores that dtype, or fp8 (converted on write).

        Meant for the start of a forward pass: one comparison, instead of a bare indexing
        error from the first layer's write.
        """
        if kv_dtype != self._dtype and not is_fp8(self._dtype):
            raise KVCacheDtypeMismatch(kv_dtype, self._dtype)

    def execute(self, plan: MemoryPlan) -> None:
        """Run a step's whole plan, in order, before the forward pass that needs it.

        Consecutive moves of one kind run as one indexed copy (`MemoryPlan.batches` splits
        them where that would differ from running them one by one). There is no per-kind entry
        point: a block a swap-out saves may be a later copy's destination, so only the plan's
        own order is safe.
        """
        for batch in plan.batches():
            if batch.kind is MoveKind.COPY:
                self._copy(batch.srcs, batch.dsts)
            elif batch.kind is MoveKind.SWAP_OUT:
                self._swap_out(batch.srcs, batch.dsts)
            else:
                self._swap_in(batch.srcs, batch.dsts)

    def _copy(self, srcs: list[int], dsts: list[int]) -> None:
        """Copy-on-write: device blocks to device blocks, in every layer, K and V."""
        src, dst = self._device_index(srcs), self._device_index(dsts)
        self.cache.index_copy_(2, dst, self.cache.index_select(2, src))

    def _swap_out(self, device_blocks: list[int], cpu_blocks: list[int]) -> None:
        """Device blocks into the swap space, one copy per run of consecutive CPU blocks.

        On the same device the gather writes straight into the swap space; across devices
        the blocks are packed on the device, then copied into the pinned swap space without
        waiting (the copy is ordered on the stream before any later swap-in reads it).
        """
        blocks = self.cache.movedim(2, 0)  # [num_blocks, num_layers, 2, ...], a view
        index = self._device_index(device_blocks)
        for start, stop, first_cpu in _consecutive_runs(cpu_blocks):
            target = self.swap_space[first_cpu : first_cpu + stop - start]
            if blocks.device == target.device:
                torch.index_select(blocks, 0, index[start:stop], out=target)
            else:
                target.copy_(blocks.index_select(0, index[start:stop]), non_blocking=True)

    def _swap_in(self, cpu_blocks: list[int], device_blocks: list[int]) -> None:
        """Swap-space blocks back into device blocks, one copy per run of consecutive CPU blocks."""
        index = self._device_index(device_blocks)
        for start, stop, first_cpu in _consecutive_runs(cpu_blocks):
            source = self.swap_space[first_cpu : first_cpu + stop - start]
            source = source.to(self.cache.device, non_blocking=True)
            self.cache.index_copy_(2, index[start:stop], source.movedim(0, 2))

    def _device_index(self, block_ids: list[int]) -> Tensor:
        return torch.tensor(block_ids, dtype=torch.int64, device=self.cache.device)


def _consecutive_runs(block_ids: list[int]) -> Iterator[tuple[int, int, int]]:
    """`(start, stop, first_id)` of each slice of `block_ids` counting up by one.

    A slice longer than `MAX_BLOCKS_PER_SWAP_COPY` is split into runs of at most that length.
    """
    start = 0
    for position in range(1, len(block_ids) + 1):
        if (
            position == len(block_ids)
            or block_ids[position] != block_ids[position - 1] + 1
            or position - start == MAX_BLOCKS_PER_SWAP_COPY
        ):
            yield start, position, block_ids[start]
            start = position


def bytes_per_block(model: DecoderModel | ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together (arithmetic from KVSpec)."""
    return kv_spec(model, dtype).bytes_per_block(block_size)


def kv_spec(model: DecoderModel | ModelConfig, dtype: torch.dtype) -> KVSpec:
    """The model's KV arithmetic for a cache storing `dtype`: the config's KV heads, or a
    tensor-parallel shard's own (each rank's cache holds only its heads). No sliding window:
    the engine keeps every token's blocks, windowed layers or not, so a request holds all its
    tokens."""
    if isinstance(model, ModelConfig):
        config, num_kv_heads = model, model.num_kv_heads
    else:
        config, num_kv_heads = model.config, model.num_kv_heads
    return KVSpec(
        num_layers=config.num_layers,
        kv_dtype=_KV_DTYPE_NAMES[dtype],
        num_kv_heads=num_kv_heads,
        head_dim=config.head_dim,
    )


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """What a cache of `kv_cache_dtype` (vLLM's values, `KV_CACHE_DTYPES`) stores: the model's
    dtype for "auto", else the fp8 format named ("fp8" is e4m3, as in vLLM)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return FP8_DTYPES[kv_cache_dtype]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """How reports name what a cache stores: `float32`, `bfloat16`, `fp8_e4m3`, `fp8_e5m2`."""
    if dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    if dtype == torch.float8_e5m2:
        return "fp8_e5m2"
    return str(dtype).removeprefix("torch.")
