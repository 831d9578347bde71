"""KVCache: the key/value tensors of every layer, and the ops that execute memory plans.

The memory manager (`pagedkv.memory`) decides which block ids hold what; this class owns the
bytes. All layers' K and V live in one tensor `[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]`, so a copy-on-write or a swap of a block moves it in every layer with
one indexing op. A CPU-side pool of the same block shape receives swapped-out blocks.

Plans must run in the order the memory manager returned them, each before the next forward
pass: a block that `swap_out` releases can be the destination of a copy-on-write or a
`swap_in` returned later in the same step, so running that later plan first would overwrite
KV before it is saved.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pagedkv.model.config import ModelConfig
from pagedkv.model.errors import KVCacheTooSmall
from pagedkv.spec import KVSpec

BlockPairs = Sequence[tuple[int, int]]
_KV_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class KVCache:
    """Paged K/V storage on the model's device plus a CPU swap space of the same block shape."""

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
    ) -> None:
        device = torch.device(device)
        block_shape = (block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.cache = torch.zeros(
            num_layers, 2, num_blocks, *block_shape, dtype=dtype, device=device
        )
        # Pinned host memory lets swaps overlap with compute on a GPU; plain memory otherwise.
        self.swap_space = torch.zeros(
            num_layers,
            2,
            num_cpu_blocks,
            *block_shape,
            dtype=dtype,
            device="cpu",
            pin_memory=device.type == "cuda",
        )

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        *,
        block_size: int,
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        num_cpu_blocks: int = 0,
        cpu_memory_bytes: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """A cache shaped for `config`, sized by `num_blocks` or by a byte budget (not both).

        `cpu_memory_bytes`, when given, sizes the swap space instead of `num_cpu_blocks`.
        """
        if (num_blocks is None) == (memory_bytes is None):
            raise ValueError("give exactly one of num_blocks and memory_bytes")
        per_block = bytes_per_block(config, block_size, dtype)
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
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=dtype,
            device=device,
            num_cpu_blocks=num_cpu_blocks,
        )

    @property
    def num_blocks(self) -> int:
        """Blocks on the model's device (the memory manager's `num_gpu_blocks`)."""
        return self.cache.shape[2]

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks in the CPU swap space."""
        return self.swap_space.shape[2]

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        """Views `(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads, head_dim]`."""
        return self.cache[index, 0], self.cache[index, 1]

    def copy_blocks(self, pairs: BlockPairs) -> None:
        """Copy-on-write: copy each `(src, dst)` block, in every layer, before `dst` is written.

        Run it in the manager's plan order: `dst` may be a block an earlier `swap_out` of the
        same step released, and that swap must have saved it first.
        """
        if pairs:
            src, dst = self._indices(pairs, self.cache.device, self.cache.device)
            self.cache[:, :, dst] = self.cache[:, :, src]

    def swap_out(self, pairs: BlockPairs) -> None:
        """Copy each `(device_block, cpu_block)` from the cache to the swap space.

        Run it in the manager's plan order, before any later copy or `swap_in` of the same step:
        those may write into the device blocks this swap releases.
        """
        if pairs:
            device_ids, cpu_ids = self._indices(pairs, self.cache.device, self.swap_space.device)
            self.swap_space[:, :, cpu_ids] = self.cache[:, :, device_ids].to("cpu")

    def swap_in(self, pairs: BlockPairs) -> None:
        """Copy each `(cpu_block, device_block)` from the swap space back into the cache.

        Run it in the manager's plan order: `device_block` may be one an earlier `swap_out` of
        the same step released, and that swap must have saved it first.
        """
        if pairs:
            cpu_ids, device_ids = self._indices(pairs, self.swap_space.device, self.cache.device)
            self.cache[:, :, device_ids] = self.swap_space[:, :, cpu_ids].to(self.cache.device)

    @staticmethod
    def _indices(
        pairs: BlockPairs, first_device: torch.device, second_device: torch.device
    ) -> tuple[Tensor, Tensor]:
        first, second = zip(*pairs, strict=True)
        return (
            torch.tensor(first, dtype=torch.int64, device=first_device),
            torch.tensor(second, dtype=torch.int64, device=second_device),
        )


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together (arithmetic from KVSpec)."""
    spec = KVSpec(
        num_layers=config.num_layers,
        kv_dtype=_KV_DTYPE_NAMES[dtype],
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
    )
    return spec.bytes_per_block(block_size)
