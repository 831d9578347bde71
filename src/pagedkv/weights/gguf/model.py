"""GGUFModel: a GGUF file read as a model and a tokenizer.

One reading of the file serves loading and `convert.py`: metadata -> config.json keys
(`config.py`), tensors -> dequantised, un-permuted Hugging Face tensors (`tensors.py`),
tokenizer metadata -> tokenizer files (`pagedkv.tokenizer`). A converted folder therefore loads to
exactly the model that loading the GGUF file gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedkv.model.config import ModelConfig, with_overrides
from pagedkv.model.decoder import DecoderModel
from pagedkv.model.errors import MissingTensor, TensorShapeMismatch
from pagedkv.parallel.group import building_group
from pagedkv.quant.schemes import resolve_quantization
from pagedkv.tokenizer import Tokenizer
from pagedkv.weights.assemble import build_model
from pagedkv.weights.gguf.config import config_dict
from pagedkv.weights.gguf.file import GGUFFile
from pagedkv.weights.gguf.packed import packed_tensors
from pagedkv.weights.gguf.tensors import gguf_tensor_name, gguf_tensors, layer_tensor_names
from pagedkv.weights.gguf.tokenizer import TokenizerFiles, tokenizer_files


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF file read as far as its metadata: config and tokenizer, tensors still on disk."""

    file: GGUFFile
    config_json: dict[str, Any]
    config: ModelConfig
    tokenizer_files: TokenizerFiles

    @classmethod
    def open(cls, path: str | Path, hf_overrides: dict[str, Any] | None = None) -> GGUFModel:
        """Read the header and metadata of the GGUF file at `path`; `hf_overrides` replaces
        config.json keys of the metadata's reading (vLLM's option)."""
        file = GGUFFile(path)
        config_json, source = with_overrides(config_dict(file), hf_overrides, file.path)
        return cls(
            file=file,
            config_json=config_json,
            config=ModelConfig.from_dict(config_json, source),
            tokenizer_files=tokenizer_files(file),
        )

    def tokenizer(self) -> Tokenizer:
        """The tokenizer, built the way a converted folder's files would build it."""
        files = self.tokenizer_files
        return Tokenizer.from_parts(
            files.tokenizer,
            files.tokenizer_config,
            files.generation_config,
            self.config_json,
            self.file.path,
        )

    def model(
        self,
        *,
        dtype: torch.dtype | str = "float32",
        device: torch.device | str = "cpu",
        quantization: str = "none",
        download_dir: str | None = None,
    ) -> DecoderModel:
        """Read the weights one tensor at a time into an eval-mode model.

        `quantization` (as `quant.schemes.resolve_quantization` resolves it) "auto" keeps the
        file's quantised blocks as they are (re-packed once into a cache, `packed.py`); "none"
        dequantises them to `dtype`; "int8"/"int4" re-quantise every projection. The re-packed
        cache goes under `download_dir` when one is given.
        """
        path = self.file.path
        keep = resolve_quantization(quantization, device) == "auto"
        stream = gguf_tensors(self.file, self.config, keep_quantized=keep)
        if keep:  # re-packed once (by rank 0), then mapped from the cache (`packed.py`)
            write = building_group().rank == 0
            stream = packed_tensors(self.file, stream, download_dir, write)
        tensors = ((path, name, tensor) for name, tensor in stream)
        try:
            return build_model(
                self.config, tensors, path, dtype=dtype, device=device, quantization=quantization
            )
        except (MissingTensor, TensorShapeMismatch) as error:  # named as the file holds it
            name = gguf_tensor_name(error.name, layer_tensor_names(self.file))
            if isinstance(error, MissingTensor):
                raise MissingTensor(path, name) from None
            raise TensorShapeMismatch(
                path, name, error.expected, error.got, implied_by="the metadata"
            ) from None
