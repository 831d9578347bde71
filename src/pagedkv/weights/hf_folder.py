"""Load a model from a local Hugging Face folder: config.json and safetensors, single or sharded.

The tensors are read one at a time and handed to `assemble.build_model`, which checks and
places each as it arrives.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from pagedkv.model.config import ModelConfig, read_config, read_json
from pagedkv.model.decoder import DecoderModel
from pagedkv.model.errors import (
    MalformedModelFile,
    MissingTensor,
    ModelFileMissing,
    UnsupportedModel,
)
from pagedkv.weights.assemble import build_model

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# What fetches either layout of a checkpoint: the one file, or the index and its shards
# (`model-00001-of-00004.safetensors`), and not a repo's other copies of the same weights
# (Mistral's `consolidated.safetensors`).
WEIGHT_PATTERNS = ("model*.safetensors", INDEX_FILE)


def load_model(
    folder: str | Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    config: ModelConfig | None = None,
    quantization: str = "none",
) -> DecoderModel:
    """Read config.json and the safetensors weights of `folder` into an eval-mode model.

    `dtype` is float32 (the CPU default), bfloat16 or float16, as a torch dtype or its name;
    `config`, when the caller has already parsed config.json, saves reading it again;
    `quantization` "int8"/"int4" quantises the projections as they load ("auto" and "none"
    keep a float checkpoint float).
    """
    folder = Path(folder)
    if config is None:
        raw = read_config(folder)
        check_not_prequantised(raw, folder / "config.json")
        config = ModelConfig.from_dict(raw, folder / "config.json")
    return build_model(
        config,
        _checkpoint_tensors(folder),
        _weights_source(folder),
        dtype=dtype,
        device=device,
        quantization=quantization,
    )


def check_not_prequantised(raw_config: dict[str, Any], source: Path) -> None:
    """Refuse a checkpoint stored quantised (GPTQ, AWQ, fp8, bitsandbytes...): its tensors
    are codes and scales that pagedkv does not read, and some (fp8) would load as floats
    silently wrong."""
    quantization = raw_config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise UnsupportedModel(
            source,
            f"quantization_config (quant_method {method!r}): pre-quantised checkpoints are not "
            "read; load the float checkpoint (quantised here with quantization int8 or int4) "
            "or a GGUF file",
        )


def _checkpoint_tensors(folder: Path) -> Iterator[tuple[Path, str, Tensor]]:
    """Yield `(file, name, tensor)` for every tensor of a single or sharded checkpoint."""
    for path, names in _weight_files(folder):
        try:
            with safe_open(path, framework="pt", device="cpu") as file:
                available = set(file.keys())
                for name in names if names is not None else sorted(available):
                    if name not in available:
                        raise MissingTensor(path, name)
                    yield path, name, file.get_tensor(name)
        except SafetensorError as error:
            raise MalformedModelFile(path, f"not a valid safetensors file: {error}") from error


def _weight_files(folder: Path) -> list[tuple[Path, list[str] | None]]:
    """The checkpoint's files, each with the tensor names the index assigns it (None: all)."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path, what="the shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise MalformedModelFile(index_path, "no 'weight_map' object naming the shards")
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            _check_shard_name(index_path, name, shard)
            shards.setdefault(shard, []).append(name)
        files = []
        for shard, names in shards.items():
            path = folder / shard
            if not path.is_file():
                raise ModelFileMissing(path, f"a shard named in {INDEX_FILE}")
            files.append((path, names))
        return files
    if (folder / SINGLE_FILE).is_file():
        return [(folder / SINGLE_FILE, None)]
    raise ModelFileMissing(
        folder / SINGLE_FILE,
        f"no weights: neither {SINGLE_FILE} nor {INDEX_FILE}",
        include=WEIGHT_PATTERNS,
    )


def _check_shard_name(index_path: Path, name: str, shard: object) -> None:
    """A shard must be a plain file name: the index may not point outside the model folder."""
    if not isinstance(shard, str):
        raise MalformedModelFile(
            index_path, f"weight_map[{name!r}] must be a shard file name, got {shard!r}"
        )
    if shard in ("", ".", "..") or "/" in shard or "\\" in shard:
        raise MalformedModelFile(
            index_path,
            f"weight_map[{name!r}] names shard {shard!r}, which is not a file name inside "
            "the model folder",
        )


def _weights_source(folder: Path) -> Path:
    index_path = folder / INDEX_FILE
    return index_path if index_path.is_file() else folder / SINGLE_FILE
