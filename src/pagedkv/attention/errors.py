"""Errors of a forward batch whose inputs cannot be computed.

Checked on the host before anything reaches the device, where an out-of-range index would be a
device-side assert (a dead CUDA context) instead of a message.
"""

from __future__ import annotations


class InvalidBatch(ValueError):
    """A sequence handed to the batch builder is inconsistent with its block table."""


class TokenIdOutOfRange(InvalidBatch):
    """A token id the embedding has no row for (checked before the lookup, not by it)."""

    def __init__(self, sequence: int, token_id: int, vocab_size: int) -> None:
        super().__init__(
            f"sequence {sequence} has token id {token_id}, outside [0, {vocab_size}) "
            f"(the model's vocab_size)"
        )
        self.token_id = token_id
        self.vocab_size = vocab_size


class PositionOutOfRange(InvalidBatch):
    """A token position past the longest context the model was configured for."""

    def __init__(self, sequence: int, context_len: int, max_positions: int) -> None:
        super().__init__(
            f"sequence {sequence} reaches position {context_len - 1}, but the model allows "
            f"{max_positions} positions (max_position_embeddings)"
        )
        self.context_len = context_len
        self.max_positions = max_positions


class KVCacheDtypeMismatch(TypeError):
    """K/V of one dtype meet a KV cache of another: a cache stores the model's dtype, or fp8
    (converted on write and read)."""

    def __init__(self, kv_dtype: object, cache_dtype: object) -> None:
        super().__init__(
            f"the model's K/V are {kv_dtype} but the KV cache holds {cache_dtype}; a cache "
            f"stores the model's dtype or an fp8 format: make it with KVCache.for_model(model) "
            f"(the model's dtype) or pass an fp8 dtype"
        )
        self.kv_dtype = kv_dtype
        self.cache_dtype = cache_dtype


class NoForwardContext(RuntimeError):
    """A layer asked for the step it belongs to outside a forward pass: attention reads the
    batch and the KV cache from the context `DecoderModel.forward` sets for its duration."""

    def __init__(self) -> None:
        super().__init__(
            "no forward pass is running: attention layers read the step's batch and KV cache "
            "from the forward context, so call the model (DecoderModel.forward), or run the "
            "layer inside `with forward_context(ForwardContext(...))`"
        )
