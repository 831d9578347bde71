"""Errors raised while reading a model's files: config, weights, tokenizer.

Every message names the file (or limit) and what is wrong with it, so a user can fix the
folder without reading our code.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pagedkv.hf_cache import snapshot_hint


class ModelError(Exception):
    """Base of every error raised about a model's files."""


class ModelFileMissing(ModelError):
    """A file the model needs is not in the folder (in a Hugging Face cache snapshot: with the
    command that fetches it, or the files matching `include` where it may be one of several)."""

    def __init__(self, path: Path, what: str, include: Sequence[str] = ()) -> None:
        super().__init__(f"{path}: missing ({what}){snapshot_hint(path, include)}")
        self.path = path


class MalformedModelFile(ModelError):
    """A file is present but cannot be parsed, or a field in it has the wrong type or value."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path


class UnsupportedModel(ModelError):
    """The config asks for an architecture or feature this engine does not implement."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path


class MissingTensor(ModelError):
    """A weight the architecture needs is in none of the safetensors files."""

    def __init__(self, path: Path, name: str) -> None:
        super().__init__(f"{path}: tensor {name!r} is missing")
        self.path = path
        self.name = name


class TensorShapeMismatch(ModelError):
    """A weight's shape disagrees with what the config implies (config.json, or a GGUF file's
    metadata: `implied_by`)."""

    def __init__(
        self,
        path: Path,
        name: str,
        expected: tuple[int, ...],
        got: tuple[int, ...],
        implied_by: str = "config.json",
    ) -> None:
        super().__init__(
            f"{path}: tensor {name!r} has shape {list(got)}, {implied_by} implies {list(expected)}"
        )
        self.path = path
        self.name = name
        self.expected = expected
        self.got = got


class ChatTemplateError(ModelError):
    """A conversation cannot be rendered: no template, or the template rejected it."""


class UnsupportedTensorType(ModelError):
    """A GGUF tensor is stored in a quantisation type this engine cannot dequantise."""

    def __init__(self, path: Path, name: str, tensor_type: str, supported: list[str]) -> None:
        super().__init__(
            f"{path}: tensor {name!r} has type {tensor_type}, which is not supported "
            f"(supported: {', '.join(supported)})"
        )
        self.path = path
        self.name = name
        self.tensor_type = tensor_type


class ConvertTargetExists(ModelError):
    """A conversion would overwrite a folder that already holds files."""

    def __init__(self, path: Path) -> None:
        what = "is a file" if path.is_file() else "already exists and is not empty"
        super().__init__(f"{path}: {what} (choose a new folder)")
        self.path = path
