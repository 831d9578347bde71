"""Errors of sizing and using the KV cache tensors."""

from __future__ import annotations


class KVCacheTooSmall(ValueError):
    """A memory budget for the KV cache does not hold even one block."""

    def __init__(self, budget_bytes: int, bytes_per_block: int) -> None:
        super().__init__(
            f"KV cache budget of {budget_bytes} bytes holds no block "
            f"(one block of all layers needs {bytes_per_block} bytes)"
        )
        self.budget_bytes = budget_bytes
        self.bytes_per_block = bytes_per_block
