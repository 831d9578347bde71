"""One entry point from a `--model` argument to a ready model and tokenizer.

`model` may be a Hugging Face folder, a `.gguf` file or a built-in name; the engine, the
commands and the tests all go through `load`, so the three sources cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.model.config import ModelConfig
from pagedkv.model.errors import ModelFileMissing
from pagedkv.model.llama import LlamaModel
from pagedkv.model.loader import load_model
from pagedkv.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    """A model in eval mode, its tokenizer and config, the name it was asked for, its files."""

    model: LlamaModel
    tokenizer: Tokenizer
    config: ModelConfig
    name: str
    path: Path


def load(
    model: str | Path,
    *,
    dtype: torch.dtype | str = "float32",
    device: torch.device | str = "cpu",
) -> LoadedModel:
    """Load `model` (a Hugging Face folder, a `.gguf` file or a built-in name)."""
    path = Path(model)
    if not path.is_dir():
        raise ModelFileMissing(path, "a model folder")
    llama = load_model(path, dtype=dtype, device=device)
    return LoadedModel(
        model=llama,
        tokenizer=Tokenizer.from_folder(path),
        config=llama.config,
        name=str(model),
        path=path,
    )
