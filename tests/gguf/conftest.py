"""Tiny GGUF files written from the tiny model zoo of tests/model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.gguf.writer import write_model_gguf
from tests.model.conftest import zoo  # noqa: F401 - the session fixture, shared with tests/model


@pytest.fixture
def tiny_gguf(zoo, tmp_path) -> Callable[..., Path]:  # noqa: F811
    """`tiny_gguf(name, **options)`: zoo model `name` written as a GGUF file (see writer)."""

    def write(name: str, **options) -> Path:
        arch = "qwen2" if name == "qwen2" else "llama"
        path = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}.gguf"
        return write_model_gguf(path, zoo.folder(name), arch=arch, **options)

    return write
