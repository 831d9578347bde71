"""Convert a GGUF file into a Hugging Face folder (float32 safetensors and tokenizer files).

The folder is written from the same reading of the file that loading it uses (`GGUFModel`),
so it loads to exactly the same model, and transformers reads it as a plain checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import save_file

from pagedkv.model.errors import ConvertTargetExists
from pagedkv.weights.gguf.model import GGUFModel
from pagedkv.weights.gguf.tensors import gguf_tensors
from pagedkv.weights.hf_folder import SINGLE_FILE


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
    try:
        save_file(weights, folder / SINGLE_FILE, metadata={"format": "pt"})
    except SafetensorError as error:  # safetensors' own type for a failed write (a full disk)
        raise OSError(f"{folder / SINGLE_FILE}: {error}") from None
    del weights
    files = gguf_model.tokenizer_files
    files.tokenizer.save(str(folder / "tokenizer.json"))
    for name, content in (
        ("config.json", gguf_model.config_json),
        ("tokenizer_config.json", files.tokenizer_config),
        ("generation_config.json", files.generation_config),
    ):
        (folder / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
