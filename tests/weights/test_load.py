"""`load()`: one entry point for Hugging Face folders, GGUF files and built-in names."""

from __future__ import annotations

import pytest
import torch

from pagedkv.hub import UnknownModelName
from pagedkv.weights.load import LoadedModel, load


def test_load_folder_gives_model_tokenizer_and_config(zoo):
    folder = zoo.folder("llama")
    loaded = load(folder)
    assert isinstance(loaded, LoadedModel)
    assert loaded.path == folder
    assert loaded.config == loaded.model.config
    assert loaded.tokenizer.eos_token_ids == (2,)
    for name, tensor in zoo.ours("llama").state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name


def test_load_in_bfloat16(zoo):
    loaded = load(zoo.folder("qwen2"), dtype="bfloat16")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16


def test_load_unknown_model_names_it_and_the_builtin_names(tmp_path):
    with pytest.raises(UnknownModelName, match="nowhere.*smollm2-135m-instruct"):
        load(tmp_path / "nowhere")
