"""Errors raised while loading a model folder or sizing its KV cache.

Every message names the file (or limit) and what is wrong with it, so a user can fix the
folder without reading our code.
"""

from __future__ import annotations

from pathlib import Path


class ModelError(Exception):
    """Base of every error `pagedkv.model` raises about a model folder or its cache."""


class ModelFileMissing(ModelError):
    """A file the model needs is not in the folder."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(f"{path}: missing ({what})")
        self.path = path


class MalformedModelFile(ModelError):
    """A file is present but cannot be parsed, or a field in it has the wrong type or value."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path


class UnsupportedModel(ModelError):
    """The config asks for an architecture or feature this engine does not implement."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path


class MissingTensor(ModelError):
    """A weight the architecture needs is in none of the safetensors files."""

    def __init__(self, path: Path, name: str) -> None:
        super().__init__(f"{path}: tensor {name!r} is missing")
        self.path = path
        self.name = name


class TensorShapeMismatch(ModelError):
    """A weight's shape disagrees with what config.json implies."""

    def __init__(
        self, path: Path, name: str, expected: tuple[int, ...], got: tuple[int, ...]
    ) -> None:
        super().__init__(
            f"{path}: tensor {name!r} has shape {list(got)}, config.json implies {list(expected)}"
        )
        self.path = path
        self.name = name


class KVCacheTooSmall(ModelError):
    """A memory budget for the KV cache does not hold even one block."""

    def __init__(self, budget_bytes: int, bytes_per_block: int) -> None:
        super().__init__(
            f"KV cache budget of {budget_bytes} bytes holds no block "
            f"(one block of all layers needs {bytes_per_block} bytes)"
        )
        self.budget_bytes = budget_bytes
        self.bytes_per_block = bytes_per_block


class InvalidBatch(ModelError, ValueError):
    """A sequence handed to the batch builder is inconsistent with its block table."""


class ChatTemplateError(ModelError):
    """A conversation cannot be rendered: no template, or the template rejected it."""


class UnsupportedTensorType(ModelError):
    """A GGUF tensor is stored in a quantisation type this engine cannot dequantise."""

    def __init__(self, path: Path, name: str, tensor_type: str, supported: list[str]) -> None:
        super().__init__(
            f"{path}: tensor {name!r} has type {tensor_type}, which is not supported "
            f"(supported: {', '.join(supported)})"
        )
        self.path = path
        self.name = name
        self.tensor_type = tensor_type


class ConvertTargetExists(ModelError):
    """A conversion would overwrite a folder that already holds files."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"{path}: already exists and is not empty (choose a new folder)")
        self.path = path


class UnknownModelName(ModelError):
    """A `--model` value that is neither a file, a folder nor a built-in model name."""

    def __init__(self, name: str, builtin: list[str]) -> None:
        super().__init__(
            f"{name!r} is not a model folder, a .gguf file or a built-in model "
            f"(built-in: {', '.join(builtin)})"
        )
        self.name = name


class PullFailed(ModelError):
    """Downloading or verifying a built-in model failed; nothing was left in the cache."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"pulling {name!r} failed: {problem}")
        self.name = name


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


class KVCacheDtypeMismatch(ModelError, TypeError):
    """K/V of one dtype meet a KV cache of another: the cache must be made in the model's dtype."""

    def __init__(self, kv_dtype: object, cache_dtype: object) -> None:
        super().__init__(
            f"the model's K/V are {kv_dtype} but the KV cache holds {cache_dtype}; "
            f"make the cache with KVCache.for_model(model) (it takes the model's dtype)"
        )
        self.kv_dtype = kv_dtype
        self.cache_dtype = cache_dtype
