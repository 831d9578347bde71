"""One entry point from a `--model` argument to a ready model and tokenizer.

`model` may be a Hugging Face folder, a `.gguf` file, a built-in name or the repo id of a model
already in the local Hugging Face cache (`hf_cache.py`; a `revision` picks its snapshot); the
engine, the commands and the tests all go through `load`, so the sources cannot drift apart.

A built-in model is pulled on first use. Under quantization "auto" (the default) its GGUF
file is read directly and its blocks kept as they are (no float32 copy is ever made; re-packed
once into a memory-mapped cache, `gguf/packed.py`); asked for float weights ("none"), it is
converted once into a float32 Hugging Face folder beside the file, so later starts read
safetensors instead of dequantising again (the folder is named by a digest of the conversion
code, so a newer pagedkv converts again and removes the old folder). A `.gguf` path given
directly is read the same way under "auto"; under "none" it is dequantised on every load:
caching a float32 copy of an arbitrary, possibly multi-gigabyte file is a choice `pagedkv
convert` leaves to the user.

What loading spent is kept by phase (`LoadedModel.seconds`) for the engine's start-up line: a
first start that compiles the CPU kernels or pulls the model should say so, not just be slow.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedkv.hf_cache import cached_model, fetch_command, hub_cache, hub_name
from pagedkv.hub import BUILTIN_MODELS, UnknownModelName, gguf_path, is_pulled, model_dir, pull
from pagedkv.kernels import native
from pagedkv.model.config import ModelConfig, read_config, with_overrides
from pagedkv.model.decoder import DecoderModel
from pagedkv.model.errors import ConvertTargetExists
from pagedkv.quant.schemes import resolve_quantization
from pagedkv.tokenizer import Tokenizer
from pagedkv.weights import gguf as gguf_package
from pagedkv.weights.gguf.convert import convert_gguf
from pagedkv.weights.gguf.model import GGUFModel
from pagedkv.weights.hf_folder import check_not_prequantised, load_model


def _conversion_stamp() -> str:
    """A digest of the code that turns a GGUF file into a folder (every module of
    `weights/gguf`): a conversion made by other code is made again, not served stale."""
    digest = hashlib.sha256()
    for source in sorted(Path(gguf_package.__file__).parent.glob("*.py")):
        if source.name != "packed.py":  # the blocks' cache, which no conversion uses
            digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


# Inside a built-in model's cache folder, named by the code that converted it.
CONVERTED_FOLDER = f"hf-{_conversion_stamp()}"


@dataclass(frozen=True)
class LoadedModel:
    """A model in eval mode, its tokenizer and config, the name it was asked for, its files,
    and the seconds loading spent by phase, in order: "pull" and "convert" when a built-in
    model was downloaded or converted now, "kernels" on a CPU, "weights" (and tokenizer)."""

    model: DecoderModel
    tokenizer: Tokenizer
    config: ModelConfig
    name: str
    path: Path
    seconds: dict[str, float] = field(default_factory=dict)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def load(
    model: str | Path,
    *,
    dtype: torch.dtype | str = "float32",
    device: torch.device | str = "cpu",
    quantization: str = "auto",
    load_format: str = "auto",
    hf_overrides: dict[str, Any] | None = None,
    download_dir: str | None = None,
    revision: str | None = None,
    progress: Callable[[str], None] = _to_stderr,
) -> LoadedModel:
    """Load `model`: a Hugging Face folder, a `.gguf` file, a built-in name (pulled once) or a
    repo id in the Hugging Face cache (at `revision`, which only a repo id takes).

    An existing path wins over a built-in name of the same spelling, and both over a repo id.
    `quantization` says what the weights are kept as (`assemble.build_model`; "auto", the
    engine's default too, keeps a GGUF file's blocks and a float checkpoint float); a built-in
    model under "auto" loads its GGUF file with the blocks as they are, under "none" its float32
    folder. `progress` receives a line per step of a first-use pull and conversion (stderr by
    default: stdout is the commands' output). vLLM's `load_format` ("auto", "safetensors",
    "gguf") refuses a model of another format; `hf_overrides` replaces config.json keys (of a
    GGUF file: of its metadata read as config.json); a built-in model is pulled into
    `download_dir` when given, and a repo id is looked up there (vLLM downloads there).
    """
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    name = str(model)
    path = find_source(name, revision, download_dir)
    if path is not None:
        _check_format(load_format, "gguf" if path.is_file() else "safetensors", name)
    else:
        keeps_blocks = resolve_quantization(quantization, device) == "auto"
        # Checked before anything is pulled: under quantization "none" it is read from the
        # float32 folder converted from its GGUF file.
        _check_format(load_format, "gguf" if keeps_blocks else "safetensors", name)
        if not is_pulled(name, download_dir):
            pull(name, progress=progress, download_dir=download_dir)
            seconds["pull"] = _lap(started)
        path = gguf_path(name, download_dir)
        if not keeps_blocks:
            convert_started = time.perf_counter()
            fresh = not (model_dir(name, download_dir) / CONVERTED_FOLDER).is_dir()
            path = converted_folder(name, progress=progress, download_dir=download_dir)
            if fresh:
                seconds["convert"] = _lap(convert_started)
    if torch.device(device).type == "cpu":
        kernels_started = time.perf_counter()
        native.kernels()  # compiled on a machine's first start, then loaded from the cache
        seconds["kernels"] = _lap(kernels_started)
    weights_started = time.perf_counter()
    if path.is_file():
        gguf_model = GGUFModel.open(path, hf_overrides)
        loaded = LoadedModel(
            model=gguf_model.model(
                dtype=dtype, device=device, quantization=quantization, download_dir=download_dir
            ),
            tokenizer=gguf_model.tokenizer(),
            config=gguf_model.config,
            name=path.stem if Path(name).exists() else name,  # a path: its file's name
            path=path,
            seconds=seconds,
        )
    elif path.is_dir():
        # Parsed once: the model and the eos ids both read it.
        raw_config, source = with_overrides(read_config(path), hf_overrides, path / "config.json")
        check_not_prequantised(raw_config, source)
        config = ModelConfig.from_dict(raw_config, source)
        loaded = LoadedModel(
            model=load_model(
                path, dtype=dtype, device=device, config=config, quantization=quantization
            ),
            tokenizer=Tokenizer.from_folder(path, config=raw_config),
            config=config,
            name=name,
            path=path,
            seconds=seconds,
        )
    else:
        raise ValueError(f"{name!r} exists but is neither a file nor a folder")
    seconds["weights"] = _lap(weights_started)
    return loaded


def find_source(
    name: str,
    revision: str | None,
    download_dir: str | None,
    field: str = "revision",
    default_revision: str | None = None,
) -> Path | None:
    """Where model or tokenizer `name` is read from, in this order: an existing path; None for
    a built-in model's name (pulled by name); the cached snapshot of Hub repo id `name` at
    `revision`, else `default_revision` (or the GGUF file of vLLM's `REPO_ID:QUANT_TYPE` in
    it). UnknownModelName when it is none of them; NoRevisions (naming `field`) for a
    `revision` of a path or built-in model."""
    path = Path(name)
    if path.exists() or name in BUILTIN_MODELS:
        if revision is not None:
            raise NoRevisions(field, revision, name)
        return path if path.exists() else None
    revision = default_revision if revision is None else revision
    cached = cached_model(name, revision, download_dir)
    if cached is None:
        parsed = hub_name(name)
        if parsed is None:  # not spelled as a Hub name: not looked for in the cache
            raise UnknownModelName(name, list(BUILTIN_MODELS))
        fetch = fetch_command(parsed, revision, download_dir)
        raise UnknownModelName(name, list(BUILTIN_MODELS), (hub_cache(download_dir), fetch))
    return cached


class NoRevisions(ValueError):
    """A revision given for a local path or a built-in model, which have none."""

    def __init__(self, field: str, revision: str, name: str) -> None:
        what = "a local path" if Path(name).exists() else "a built-in model"
        super().__init__(
            f"{field} {revision!r}: {name!r} is {what}, which has no revisions (a revision "
            "picks the snapshot of a Hugging Face repo id in the local cache; leave it None)"
        )


def _check_format(load_format: str, found: str, name: str) -> None:
    """Refuse a model whose files are not the `load_format` asked for ("auto": any)."""
    if load_format not in ("auto", found):
        held = "a .gguf file" if found == "gguf" else "a Hugging Face folder (safetensors)"
        raise ValueError(f"load_format {load_format!r}: model {name!r} is read from {held}")


def load_tokenizer(
    source: str | Path,
    vocab_size: int,
    *,
    download_dir: str | None = None,
    revision: str | None = None,
    model_revision: str | None = None,
    progress: Callable[[str], None] = _to_stderr,
) -> Tokenizer:
    """The tokenizer of `source` alone (vLLM's `tokenizer=`) for a model of `vocab_size` ids: a
    Hugging Face folder's files, a `.gguf` file's vocabulary, a built-in model's (its GGUF
    file, pulled once) or a cached Hub repo's, found as `load` finds a model. A repo is read at
    `revision` (vLLM's tokenizer_revision), else at the model's revision, as vLLM's rule says.
    One that makes ids past the model's vocabulary is refused: the model has no row for them."""
    name = str(source)
    path = find_source(name, revision, download_dir, "tokenizer_revision", model_revision)
    if path is None:
        path = pull(name, progress=progress, download_dir=download_dir)
    if path.is_file():
        tokenizer = GGUFModel.open(path).tokenizer()
    elif path.is_dir():
        tokenizer = Tokenizer.from_folder(path)
    else:
        raise ValueError(f"{name!r} exists but is neither a file nor a folder")
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"tokenizer {name!r} has {tokenizer.vocab_size} ids, more than the model's "
            f"vocabulary of {vocab_size}"
        )
    return tokenizer


def _lap(started: float) -> float:
    return time.perf_counter() - started


def converted_folder(
    name: str, *, progress: Callable[[str], None] = _to_stderr, download_dir: str | None = None
) -> Path:
    """The cached Hugging Face folder of built-in model `name`, pulling and converting once."""
    folder = model_dir(name, download_dir) / CONVERTED_FOLDER
    if folder.is_dir():
        return folder
    gguf_file = pull(name, progress=progress, download_dir=download_dir)
    progress(f"{name}: converting to a float32 folder in {folder} (once)")
    # ConvertTargetExists: another process converted it meanwhile; its folder is as good.
    with contextlib.suppress(ConvertTargetExists):
        convert_gguf(gguf_file, folder)
    for stale in folder.parent.glob("hf*"):  # earlier code's conversions (or its old name)
        if stale.is_dir() and stale != folder:
            # Renamed first, atomically: no reader ever meets a half-removed folder by a
            # name it would load.
            hidden = stale.with_name(f".{stale.name}.stale-{os.getpid()}")
            with contextlib.suppress(OSError):
                stale.rename(hidden)
                shutil.rmtree(hidden, ignore_errors=True)
    return folder
