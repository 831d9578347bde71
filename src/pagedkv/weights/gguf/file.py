"""GGUFFile: an open GGUF file with typed metadata reads that name the key when they fail.

GGUF (llama.cpp's format) holds metadata as typed key/value pairs and tensors as raw, often
quantised, blocks. `reader.read_gguf` memory-maps the file, so opening it reads only the
header; tensor bytes are touched when a tensor is dequantised or re-packed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.model.errors import MalformedModelFile, ModelFileMissing
from pagedkv.weights.gguf.reader import GGUFTensor, read_gguf

_MISSING = object()


class GGUFFile:
    """Metadata and tensors of one GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise MalformedModelFile(self.path, "is a folder, not a GGUF file")
        if not self.path.is_file():
            raise ModelFileMissing(self.path, "the GGUF file")
        contents = read_gguf(self.path)
        self.fields = contents.fields
        self.tensors: dict[str, GGUFTensor] = contents.tensors
        self.header_size = contents.header_size  # bytes before the tensor data

    @property
    def architecture(self) -> str:
        """`general.architecture`, the prefix of the model's own metadata keys."""
        return self.string("general.architecture")

    def has(self, key: str) -> bool:
        """Whether the metadata holds `key`."""
        return key in self.fields

    def value(self, key: str, default: Any = _MISSING) -> Any:
        """The decoded value of `key` (str, int, float, bool or a list of them)."""
        if key not in self.fields:
            if default is _MISSING:
                raise MalformedModelFile(self.path, f"metadata key {key!r} is missing")
            return default
        return self.fields[key]

    def integer(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        """An integer >= `minimum`; `default` (when not None) stands in for an absent key."""
        value = self.value(key) if default is None else self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise MalformedModelFile(
                self.path, f"metadata {key!r} must be an integer >= {minimum}, got {value!r}"
            )
        return value

    def number(self, key: str, default: float | None = None) -> float:
        """A positive number; `default` (when not None) stands in for an absent key.

        GGUF stores float32: the shortest decimal that rounds to the same float32 is returned
        (1e-05, not 9.999999747378752e-06), as the config.json the file was made from said.
        """
        value = self.value(key) if default is None else self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise MalformedModelFile(
                self.path, f"metadata {key!r} must be a positive number, got {value!r}"
            )
        if isinstance(value, float):
            return float(str(np.float32(value)))
        return float(value)

    def string(self, key: str, default: str | None = None) -> str:
        """A string; `default` (when not None) stands in for an absent key."""
        value = self.value(key) if default is None else self.value(key, default)
        if not isinstance(value, str):
            raise MalformedModelFile(self.path, f"metadata {key!r} must be a string, got {value!r}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        """A bool, `default` when absent."""
        value = self.value(key, default)
        if not isinstance(value, bool):
            raise MalformedModelFile(
                self.path, f"metadata {key!r} must be true or false, got {value!r}"
            )
        return value

    def optional_id(self, key: str, vocab_size: int) -> int | None:
        """A token id in `[0, vocab_size)`, or None when the key is absent."""
        if not self.has(key):
            return None
        value = self.integer(key, minimum=0)
        if value >= vocab_size:
            raise MalformedModelFile(
                self.path, f"metadata {key!r} is token id {value}, vocabulary has {vocab_size}"
            )
        return value
