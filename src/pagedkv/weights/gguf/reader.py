"""read_gguf: a GGUF file's metadata as Python values and its tensors as views of the file.

GGUF (llama.cpp's format, versions 2 and 3, little-endian) is a header of typed key/value
pairs and tensor descriptions, then the tensors' raw bytes, aligned. `gguf.GGUFReader` parses
the header into a numpy view per field part (one per string of the vocabulary and the merges),
which took 4 s of the built-in model's 8 s start; this reader decodes the header in one pass
with `struct` (0.1 s) and maps the tensor bytes, so a tensor costs nothing until it is read.

Tensor data keeps `gguf.GGUFReader`'s layout, which `gguf.quants` and the block re-packers
expect: float and integer tensors as arrays of their values in PyTorch's dim order, block-
quantised ones as uint8 rows of whole blocks.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from pagedkv.model.errors import MalformedModelFile

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Scalar value types by their GGUF id: struct format of one item.
_SCALARS = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain values (everything else is blocks of bytes).
_VALUE_DTYPES = {
    QType.F32: np.float32,
    QType.F16: np.float16,
    QType.F64: np.float64,
    QType.I8: np.int8,
    QType.I16: np.int16,
    QType.I32: np.int32,
    QType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: its GGUF dims (innermost first), its type and a read-only view of its data."""

    name: str
    tensor_type: QType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFContents:
    """Everything `read_gguf` found: metadata values by key, tensors by name, in file order,
    and the header's size (the bytes before the tensor data: header, metadata, tensor infos)."""

    fields: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    header_size: int


def read_gguf(path: Path) -> GGUFContents:
    """Parse the header of the GGUF file at `path` and map its tensor data.

    Raises `MalformedModelFile` naming the problem for a bad magic or version, a truncated
    header, an unknown value or tensor type, or tensor data that runs past the end of the file.
    """
    with open(path, "rb") as handle:
        try:
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as error:  # an empty file cannot be mapped
            raise MalformedModelFile(path, f"not a valid GGUF file: {error}") from error
    try:
        return _Parser(buffer, path).contents()
    except (struct.error, UnicodeDecodeError, IndexError) as error:
        raise MalformedModelFile(path, f"not a valid GGUF file: {error}") from error


class _Parser:
    """A cursor over the mapped file that decodes header items in order."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer = buffer
        self.path = path
        self.position = 0

    def contents(self) -> GGUFContents:
        magic = self.buffer[:4]
        if magic != MAGIC:
            raise MalformedModelFile(
                self.path, f"not a valid GGUF file: magic {bytes(magic)!r}, expected {MAGIC!r}"
            )
        self.position = 4
        version = self._scalar("I")
        if version not in VERSIONS:
            raise MalformedModelFile(
                self.path,
                f"not a valid GGUF file: version {version} (supported: {VERSIONS}, little-endian)",
            )
        num_tensors = self._scalar("Q")
        num_fields = self._scalar("Q")
        fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            fields[key] = self._value(self._scalar("I"), key)
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise MalformedModelFile(self.path, f"general.alignment must be > 0, got {alignment}")
        data_start = -(-self.position // alignment) * alignment
        file_bytes = np.frombuffer(self.buffer, dtype=np.uint8)
        tensors: dict[str, GGUFTensor] = {}
        for name, shape, tensor_type, offset in infos:
            if name in tensors:
                raise MalformedModelFile(self.path, f"tensor {name!r} appears twice")
            tensors[name] = self._tensor(file_bytes, data_start + offset, name, shape, tensor_type)
        return GGUFContents(fields, tensors, data_start)

    def _tensor_info(self) -> tuple[str, tuple[int, ...], QType, int]:
        name = self._string()
        num_dims = self._scalar("I")
        shape = struct.unpack_from(f"<{num_dims}Q", self.buffer, self.position)
        self.position += 8 * num_dims
        raw_type = self._scalar("I")
        try:
            tensor_type = QType(raw_type)
        except ValueError:
            raise MalformedModelFile(
                self.path, f"tensor {name!r} has unknown type id {raw_type}"
            ) from None
        return name, shape, tensor_type, self._scalar("Q")

    def _tensor(
        self,
        file_bytes: np.ndarray,
        start: int,
        name: str,
        shape: tuple[int, ...],
        tensor_type: QType,
    ) -> GGUFTensor:
        """A view of one tensor's bytes, typed and shaped as `gguf.GGUFReader` gives it."""
        block_values, block_bytes = GGML_QUANT_SIZES[tensor_type]
        dims = tuple(reversed(shape))  # outermost first, as numpy and PyTorch order them
        if dims and dims[-1] % block_values:
            raise MalformedModelFile(
                self.path,
                f"tensor {name!r} ({tensor_type.name}): row of {dims[-1]} values is not whole "
                f"blocks of {block_values}",
            )
        num_bytes = int(np.prod(dims, dtype=np.int64)) * block_bytes // block_values
        if start + num_bytes > len(file_bytes):
            raise MalformedModelFile(
                self.path, f"tensor {name!r} runs past the end of the file (truncated?)"
            )
        raw = file_bytes[start : start + num_bytes]
        dtype = _VALUE_DTYPES.get(tensor_type)
        if dtype is not None:
            data = raw.view(dtype).reshape(dims)
        else:
            data = raw.reshape(*dims[:-1], dims[-1] // block_values * block_bytes)
        return GGUFTensor(name, tensor_type, shape, data)

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.position)
        self.position += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("Q")
        end = self.position + length
        if end > len(self.buffer):
            raise MalformedModelFile(self.path, "not a valid GGUF file: truncated header")
        text = self.buffer[self.position : end].decode("utf-8")
        self.position = end
        return text

    def _value(self, value_type: int, key: str) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            return self._array(key)
        fmt = _SCALARS.get(value_type)
        if fmt is None:
            raise MalformedModelFile(
                self.path, f"metadata {key!r} has unknown type id {value_type}"
            )
        return self._scalar(fmt)

    def _array(self, key: str) -> list[Any]:
        item_type = self._scalar("I")
        count = self._scalar("Q")
        if item_type == _STRING:
            return [self._string() for _ in range(count)]
        if item_type == _ARRAY:
            return [self._array(key) for _ in range(count)]
        fmt = _SCALARS.get(item_type)
        if fmt is None:
            raise MalformedModelFile(
                self.path, f"metadata {key!r} has unknown item type {item_type}"
            )
        dtype = np.dtype("<" + fmt)
        end = self.position + dtype.itemsize * count
        if end > len(self.buffer):
            raise MalformedModelFile(self.path, "not a valid GGUF file: truncated header")
        values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.position)
        self.position = end
        return values.tolist()
