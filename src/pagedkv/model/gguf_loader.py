"""Load a GGUF file as a model and tokenizer, or convert it into a Hugging Face folder.

Both paths share one reading of the file: metadata -> config.json keys (`gguf_config`),
tensors -> dequantised, un-permuted Hugging Face tensors (`gguf_weights`), tokenizer
metadata -> tokenizer files (`gguf_tokenizer`). A converted folder therefore loads to exactly
the model that loading the GGUF file gives, and transformers reads it as a plain checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pagedkv.model.config import ModelConfig
from pagedkv.model.errors import ConvertTargetExists
from pagedkv.model.gguf_config import config_dict
from pagedkv.model.gguf_file import GGUFFile
from pagedkv.model.gguf_tokenizer import TokenizerFiles, tokenizer_files
from pagedkv.model.gguf_weights import gguf_tensors
from pagedkv.model.llama import LlamaModel
from pagedkv.model.loader import SINGLE_FILE, build_model
from pagedkv.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF file read as far as its metadata: config and tokenizer, tensors still on disk."""

    file: GGUFFile
    config_json: dict[str, Any]
    config: ModelConfig
    tokenizer_files: TokenizerFiles

    @classmethod
    def open(cls, path: str | Path) -> GGUFModel:
        """Read the header and metadata of the GGUF file at `path`."""
        file = GGUFFile(path)
        config_json = config_dict(file)
        return cls(
            file=file,
            config_json=config_json,
            config=ModelConfig.from_dict(config_json, file.path),
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
        self, *, dtype: torch.dtype | str = "float32", device: torch.device | str = "cpu"
    ) -> LlamaModel:
        """Dequantise the weights one tensor at a time into an eval-mode model."""
        path = self.file.path
        tensors = ((path, name, tensor) for name, tensor in gguf_tensors(self.file, self.config))
        return build_model(self.config, tensors, path, dtype=dtype, device=device)


def convert_gguf(path: str | Path, folder: str | Path) -> Path:
    """Write GGUF file `path` as a Hugging Face folder (float32 safetensors); return the folder.

    The folder appears whole or not at all: it is written under a temporary name beside the
    target and renamed at the end, so an interrupted conversion leaves no half-written cache.
    """
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConvertTargetExists(folder)
    gguf_model = GGUFModel.open(path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f".{folder.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        _write_folder(gguf_model, staging)
        if folder.exists():
            folder.rmdir()  # empty, checked above
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _write_folder(gguf_model: GGUFModel, folder: Path) -> None:
    weights = dict(gguf_tensors(gguf_model.file, gguf_model.config))
    save_file(weights, folder / SINGLE_FILE, metadata={"format": "pt"})
    del weights
    files = gguf_model.tokenizer_files
    files.tokenizer.save(str(folder / "tokenizer.json"))
    for name, content in (
        ("config.json", gguf_model.config_json),
        ("tokenizer_config.json", files.tokenizer_config),
        ("generation_config.json", files.generation_config),
    ):
        (folder / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
