"""A GGUF file's re-packed weights, cached on disk once and memory-mapped on later loads.

Keeping a file's quantised blocks means re-packing them into the kernels' layout
(`quant/gguf_blocks.py`): bytes reordered, each group's scale and min worked out. It loses
nothing, but it reads and writes every byte, about 1.7 s for a 1B-class file on 2 cores, on
every start. So the first load of a file of at least `MIN_CACHED_BYTES` writes what it
re-packed (exactly the stream `gguf_tensors(keep_quantized=True)` yields) into one file under
`cache_dir() / "packed"` (under vLLM's `download_dir` when one is given), and later loads map
that file (`torch.load(mmap=True)`): no byte is read before a kernel touches it, and
processes serving the same model share its pages.

The cache file is named by the source's absolute path and records a stamp: the source's size,
mtime and a SHA-256 of its header (metadata and tensor table, `GGUFFile.header_size` bytes),
and a SHA-256 of the packing code itself (`quant/formats.py`, `quant/gguf_blocks.py`,
`weights/gguf/tensors.py`). A stamp that does not match, or a cache that cannot be read,
re-packs from the source and rewrites the cache; one that cannot be written leaves the load
as it would be without it. Smaller files re-pack faster than a cache would map and are left
out, so test suites full of tiny files leave nothing behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pagedkv.hub import cache_dir
from pagedkv.quant import formats, gguf_blocks
from pagedkv.quant.formats import QuantizedTensor
from pagedkv.weights.gguf import tensors as gguf_tensor_module
from pagedkv.weights.gguf.file import GGUFFile

MIN_CACHED_BYTES = 32 * 2**20
_PACKING_CODE = (formats.__file__, gguf_blocks.__file__, gguf_tensor_module.__file__)
Named = tuple[str, Tensor | QuantizedTensor]


def cache_path(source: Path, download_dir: str | None = None) -> Path:
    """Where the packed weights of GGUF file `source` are cached."""
    digest = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:24]
    return cache_dir(download_dir) / "packed" / f"{source.stem}-{digest}.pt"


def stamp(file: GGUFFile) -> dict[str, Any]:
    """What a cache must match to stand for `file`: its size, mtime, header and packer."""
    status = file.path.stat()
    with open(file.path, "rb") as handle:
        header = hashlib.sha256(handle.read(file.header_size)).hexdigest()
    code = hashlib.sha256(b"".join(Path(module).read_bytes() for module in _PACKING_CODE))
    return {
        "size": status.st_size,
        "mtime_ns": status.st_mtime_ns,
        "header_sha256": header,
        "packer_sha256": code.hexdigest(),
    }


def packed_tensors(
    file: GGUFFile, repack: Iterator[Named], download_dir: str | None = None, write: bool = True
) -> Iterator[Named]:
    """The file's re-packed tensors: mapped from the cache when it is current, else `repack`
    (re-packing the file), whose tensors are then written to the cache for the next load
    unless `write` is False (a tensor-parallel rank other than 0: one writer, and no rank
    holds the whole model's tensors for a cache another writes)."""
    if file.path.stat().st_size < MIN_CACHED_BYTES:
        yield from repack
        return
    path = cache_path(file.path, download_dir)
    expected = stamp(file)
    cached = _read(path, expected)
    if cached is not None:
        yield from cached
        return
    if not write:
        yield from repack
        return
    packed: list[Named] = []
    for item in repack:
        packed.append(item)
        yield item
    _write(path, expected, packed)


def _read(path: Path, expected: dict[str, Any]) -> list[Named] | None:
    """The cached tensors, mapped, if the cache exists, loads and matches `expected`."""
    if not path.is_file():
        return None
    try:
        contents = torch.load(path, mmap=True, weights_only=True)
    except Exception:  # a truncated or foreign file: re-pack and rewrite it
        return None
    if not isinstance(contents, dict) or contents.get("stamp") != expected:
        return None
    return [_tensor(entry) for entry in contents["tensors"]]


def _tensor(entry: list[Any]) -> Named:
    if entry[1] == "float":
        return entry[0], entry[2]
    name, _, values, scales, mins, bits, group_size = entry
    return name, QuantizedTensor(values, scales, mins, bits, group_size)


def _write(path: Path, expected: dict[str, Any], packed: list[Named]) -> None:
    """Save the tensors under `expected`, atomically; a cache that cannot be written is no
    reason to fail a load that has succeeded."""
    entries: list[list[Any]] = []
    for name, tensor in packed:
        if isinstance(tensor, QuantizedTensor):
            fields = (tensor.values, tensor.scales, tensor.mins)
            entries.append([name, "quantized", *map(_own, fields), tensor.bits, tensor.group_size])
        else:
            entries.append([name, "float", _own(tensor)])
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"stamp": expected, "tensors": entries}, partial)
        partial.replace(path)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink()


def _own(tensor: Tensor) -> Tensor:
    """`tensor` alone in its storage (torch.save writes a view's whole storage)."""
    if tensor.untyped_storage().nbytes() == tensor.nbytes and tensor.is_contiguous():
        return tensor
    return tensor.clone()
