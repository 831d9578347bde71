"""Load a Llama-style model from a local Hugging Face folder of safetensors.

The model is first built on the meta device (no memory), then each checkpoint tensor is read,
checked against the shape the config implies, converted to the wanted dtype and assigned in
place, so peak memory stays near the size of the weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from pagedkv.model.config import ModelConfig, load_config, read_json
from pagedkv.model.errors import (
    MalformedModelFile,
    MissingTensor,
    ModelFileMissing,
    TensorShapeMismatch,
)
from pagedkv.model.llama import LlamaModel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(
    folder: str | Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    config: ModelConfig | None = None,
) -> LlamaModel:
    """Read config.json and the safetensors weights of `folder` into an eval-mode model.

    `dtype` is float32 (the CPU default), bfloat16 or float16, as a torch dtype or its name;
    `config`, when the caller has already parsed config.json, saves reading it again.
    """
    folder = Path(folder)
    if config is None:
        config = load_config(folder)
    return build_model(
        config, _checkpoint_tensors(folder), _weights_source(folder), dtype=dtype, device=device
    )


def build_model(
    config: ModelConfig,
    tensors: Iterable[tuple[Path, str, Tensor]],
    source: Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
) -> LlamaModel:
    """Assemble an eval-mode model from `(file, checkpoint name, tensor)` triples.

    Each tensor is checked against the shape `config` implies and converted on arrival, so at
    most one source tensor is held beside the model; `source` names the weights in errors.
    """
    dtype = _resolve_dtype(dtype)
    with torch.device("meta"):
        model = LlamaModel(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    weights: dict[str, Tensor] = {}
    for path, hf_name, tensor in tensors:
        name = _parameter_name(hf_name, config)
        if name is None:
            continue
        if name not in expected:
            raise MalformedModelFile(
                path, f"unexpected tensor {hf_name!r}: not a weight of {config.architecture}"
            )
        if tuple(tensor.shape) != expected[name]:
            raise TensorShapeMismatch(path, hf_name, expected[name], tuple(tensor.shape))
        if not tensor.is_floating_point():
            # Casting would turn quantized or corrupt data into plausible-looking weights.
            raise MalformedModelFile(
                path,
                f"tensor {hf_name!r} has dtype {str(tensor.dtype).removeprefix('torch.')}, "
                "expected a floating-point weight",
            )
        weights[name] = tensor.to(device=device, dtype=dtype)
    for name in expected:
        if name not in weights:
            raise MissingTensor(source, _checkpoint_name(name))
    model.load_state_dict(weights, strict=True, assign=True)
    return model.to(device).eval().requires_grad_(False)


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")
        return DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype {dtype} is not supported (supported: {', '.join(DTYPES)})")
    return dtype


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
        folder / SINGLE_FILE, f"no weights: neither {SINGLE_FILE} nor {INDEX_FILE}"
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


def _parameter_name(hf_name: str, config: ModelConfig) -> str | None:
    """Our parameter name for a checkpoint tensor, or None for tensors we deliberately skip."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None  # older checkpoints saved the rope buffer; we recompute it
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
        return None  # some tied checkpoints still carry a copy of the embedding
    return hf_name.removeprefix("model.")


def _checkpoint_name(name: str) -> str:
    return name if name == "lm_head.weight" else f"model.{name}"
