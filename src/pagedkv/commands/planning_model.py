"""`--model` of `pagedkv plan` and `pagedkv simulate`: what kvmath resolves, and GGUF files.

kvmath sizes a model from a preset, a config.json or a model folder, with no torch. A GGUF file
(what `pagedkv serve --model FILE.gguf` loads) holds its config as metadata instead; the
engine's own GGUF reader turns it into the config.json a converted copy would carry, so the
plan sizes exactly the model the engine would serve. Only this path imports it. A Hub repo id
(or vLLM's `REPO_ID:QUANT_TYPE` of a GGUF file) already in the local Hugging Face cache is
sized from its snapshot, as the engine loads it.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

from pagedkv.hf_cache import cached_model, fetch_command, hub_cache, hub_name, snapshot_hint
from pagedkv.kvmath.presets import MODEL_PRESETS, Model, resolve_model
from pagedkv.kvmath.spec import (
    DTYPE_BYTES,
    KV_CACHE_DTYPES,
    ConfigError,
    ConfigFileError,
    KVSpec,
    format_bytes,
)
from pagedkv.model.registry import ARCHITECTURES

GGUF_MAGIC = b"GGUF"


def resolve_planning_model(
    name_or_path: str,
    kv_dtype: str | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
) -> Model:
    """The model `--model` names; a GGUF file's weights are its tensor bytes as stored. A Hub
    name is read at `revision` from `download_dir` or the default cache, as the engine reads
    it; a revision of a preset or a local path is refused (they have none)."""
    path = Path(name_or_path)
    if path.exists() or name_or_path.lower() in MODEL_PRESETS:
        if revision is not None:
            raise ConfigError(
                f"--revision {revision!r}: {name_or_path!r} is a preset or a local path, which "
                "has no revisions (a revision picks a Hugging Face repo's snapshot)"
            )
    else:
        try:
            cached = cached_model(name_or_path, revision, download_dir)
        except ValueError as exc:  # the cache has the repo, not the revision or file named
            raise ConfigError(str(exc)) from exc
        if cached is not None:
            try:
                model = resolve_planning_model(str(cached), kv_dtype)
            except ConfigFileError as exc:  # a snapshot without its config: say how to fetch it
                hint = "" if exc.path.exists() else snapshot_hint(exc.path)
                raise ConfigError(f"{exc}{hint}") from exc
            return replace(model, name=name_or_path)
        parsed = hub_name(name_or_path)
        if parsed is not None:
            fetch = fetch_command(parsed, revision, download_dir)
            raise ConfigError(
                f"--model {name_or_path!r} is neither a preset, an existing path nor a repo in "
                f"the Hugging Face cache ({hub_cache(download_dir)}; pagedkv downloads nothing: "
                f"fetch it first, e.g. `{fetch}`); presets: {', '.join(MODEL_PRESETS)}"
            )
    if not _is_gguf(path):
        return resolve_model(name_or_path, kv_dtype)
    from pagedkv.model.errors import ModelError
    from pagedkv.weights.gguf.config import config_dict
    from pagedkv.weights.gguf.file import GGUFFile

    try:
        file = GGUFFile(path)
        config = config_dict(file)
    except ModelError as exc:
        raise ConfigError(str(exc)) from exc
    weight_bytes = sum(tensor.data.nbytes for tensor in file.tensors.values())
    return Model(
        name=path.stem,
        spec=KVSpec.from_hf_config(config, kv_dtype, source=path),
        weight_bytes=weight_bytes,
        weight_source=f"{len(file.tensors)} tensors in {path.name}, as stored",
        config=config,
        gpu_weight_bytes=2 * sum(math.prod(tensor.shape) for tensor in file.tensors.values()),
    )


def _is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts as every GGUF file does."""
    if not path.is_file():
        return False
    try:
        with path.open("rb") as handle:
            return handle.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def add_hub_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's `--revision` and `--download-dir`, for a `--model` named by Hub repo id:
    the snapshot `plan` and `simulate` size is the one the engine would load."""
    parser.add_argument(
        "--revision",
        help="branch, tag or commit of a model named by Hugging Face repo id (default: main)",
    )
    parser.add_argument(
        "--download-dir",
        help="the Hugging Face cache to read a repo id from (default: huggingface_hub's)",
    )


def add_kv_dtype_arguments(parser: argparse.ArgumentParser) -> None:
    """`--kv-dtype` (bytes per value by name) or vLLM's `--kv-cache-dtype`, as the engine
    takes it: what KV is sized in, for `plan` and `simulate` alike."""
    kv_dtype = parser.add_mutually_exclusive_group()
    kv_dtype.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES), help="default: the config's")
    kv_dtype.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="vLLM's spelling, as the engine takes it: auto (the config's dtype), fp8, "
        "fp8_e4m3 or fp8_e5m2 (1 byte per value)",
    )


def kv_dtype_of(args: argparse.Namespace) -> str | None:
    """The KV dtype asked for under either spelling; None: the config's."""
    if args.kv_cache_dtype not in (None, "auto"):
        return args.kv_cache_dtype  # an fp8 name, which KVSpec reads as fp8
    return args.kv_dtype


# What `--device` sizes: how pagedkv's dtype auto stores a model there (`EngineArgs.dtype`).
DEVICES = ("cpu", "cuda")


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """The engine's `--device`: which dtype "auto" stores KV in (float32 on a CPU, bfloat16
    on a GPU), so that the plan sizes the pool the engine would hold there."""
    parser.add_argument(
        "--device",
        choices=DEVICES,
        help="size KV as the engine stores it there with dtype auto: float32 on cpu, bfloat16 "
        "(a float32 checkpoint's too) on cuda (default: the checkpoint's dtype; plan's --gpu "
        "implies cuda)",
    )


def on_device(model: Model, device: str | None, kv_dtype_given: bool) -> Model:
    """`model` as pagedkv holds it on `device` (None: as the checkpoint stores it)."""
    if device == "cuda":
        return _as_loaded_on_a_gpu(model, kv_dtype_given)
    if device == "cpu" and not kv_dtype_given:
        return replace(model, spec=replace(model.spec, kv_dtype="fp32"))
    return model


def device_note(model: Model, device: str | None, kv_dtype_given: bool) -> str | None:
    """Where no device says which dtype KV takes: what the config's dtype means on each."""
    if device is not None or kv_dtype_given:
        return None
    return (
        f"KV in {model.spec.kv_dtype}, as the config or file gives it (the engine's dtype auto: "
        "float32 on a CPU, bfloat16 on a GPU; --device picks one)"
    )


def _as_loaded_on_a_gpu(model: Model, kv_dtype_given: bool) -> Model:
    """`model` as pagedkv loads it on a GPU, where dtype auto is bfloat16: a float32 or float16
    checkpoint (or a GGUF file, which reads as float32) stores KV and weights as bfloat16
    values, and a GGUF file's quantised blocks are dequantised (there are no GPU kernels for
    them)."""
    spec = model.spec
    if not kv_dtype_given and spec.kv_dtype in ("fp32", "fp16"):
        spec = replace(spec, kv_dtype="bf16")
    loaded = model.gpu_weight_bytes
    if loaded is None or loaded == model.weight_bytes:
        return replace(model, spec=spec)
    source = f"{model.weight_source}; loaded as bf16 on a GPU: {format_bytes(loaded)}"
    return replace(model, spec=spec, weight_bytes=loaded, weight_source=source)


def family_note(model: Model) -> str | None:
    """For a config of a family pagedkv does not run: that the figures follow the config's
    fields by the rules of the families it runs, which that family's own may not (a default
    of shared embeddings, windows on alternate layers)."""
    config = model.config or {}
    architectures = config.get("architectures")
    named = architectures[0] if isinstance(architectures, list) and architectures else None
    model_type = config.get("model_type")
    if named is None and model_type is None:  # a preset of sizes only (DeepSeek-V3, GPT)
        return None
    types = {entry.model_type for entry in ARCHITECTURES.values()}
    if (named in ARCHITECTURES) if named else (model_type in types):
        return None
    return (
        f"{named or model_type} is not a family pagedkv runs ({', '.join(ARCHITECTURES)}): "
        "sized from its config by their rules (its own defaults and per-layer windows may differ)"
    )
