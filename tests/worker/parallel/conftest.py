"""Tiny model folders for the tensor-parallel tests: the engine zoo's families, plus shapes
the zoo lacks (full multi-head attention with 4 KV heads, an odd vocabulary, untied head)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.model.tiny_models import _COMMON, TINY_MODELS, TinyModel, build_model_folder

# Every KV-head count the issue names (4 here, 2 in `llama`, 1 in `llama3`), and a vocabulary
# two ranks cannot split evenly (the last rank's rows are padding).
EXTRA_MODELS = {
    "llama_mha_odd_vocab": TinyModel(
        "LlamaForCausalLM", dict(_COMMON, num_key_value_heads=4, vocab_size=321)
    ),
}
FAMILIES = [*TINY_MODELS, *EXTRA_MODELS]


@pytest.fixture(scope="session")
def tp_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's folder, built on first use."""
    root = tmp_path_factory.mktemp("tp_models")
    folders: dict[str, Path] = {}

    class Folders(dict):
        def __missing__(self, name: str) -> Path:
            folders[name] = build_model_folder(name, root / name, spec=EXTRA_MODELS.get(name))
            self[name] = folders[name]
            return folders[name]

    return Folders()
