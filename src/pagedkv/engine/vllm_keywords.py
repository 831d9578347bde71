"""vLLM's engine keywords that port a deployment but mean nothing new here: the values that
mean what pagedkv does pass, a backend pagedkv does not have is noted, and the rest are refused
by name (pagedkv fetches nothing from a hub, reads tokenizer.json with the tokenizers library,
keeps every weight on its device, splits a model by tensor parallelism only, runs one engine
per process, compiles no graphs, runs generative models with its own implementation of each
family, detokenizes every output, never sleeps and holds structured outputs with llguidance).
Settings that only tune how vLLM reaches the same outputs (its custom all-reduce, CUDA graph
capture lengths, asynchronous scheduling, a Hub token) are taken and change nothing.
"""

from __future__ import annotations

import json
import sys
from typing import Any

# vLLM's load_format values for what pagedkv reads: auto (by the path), a Hugging Face folder's
# safetensors, a GGUF file.
LOAD_FORMATS = ("auto", "safetensors", "gguf")
TOKENIZER_MODES = ("auto", "hf")
# vLLM's structured-output backends, and the switches of its StructuredOutputsConfig that
# change nothing here: JSON is written without free whitespace whatever they say, objects are
# closed as `engine/structured/grammar.py` says, and nothing falls back to another library.
STRUCTURED_BACKENDS = ("auto", "guidance", "xgrammar", "outlines", "lm-format-enforcer")
_STRUCTURED_SWITCHES = (
    "disable_any_whitespace",
    "disable_fallback",
    "disable_additional_properties",
)


def json_object(name: str, value: object) -> dict[str, Any] | None:
    """`value` as a dict: given as one, or as JSON text (a command-line flag); None stays."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is not valid JSON: {error}") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object (a dict), got {value!r}")
    return value


def check_vllm_keywords(args: Any) -> None:
    """Check vLLM's loading, compilation and structured-output keywords of `args` (an
    EngineArgs, which imports this module), as the module says; JSON given as text is read
    into the field."""
    if args.load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {args.load_format!r}")
    if args.tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(
            f"tokenizer_mode must be one of {TOKENIZER_MODES} (both read tokenizer.json with "
            f"the tokenizers library), got {args.tokenizer_mode!r}"
        )
    for name in ("revision", "tokenizer_revision"):
        if not isinstance(getattr(args, name), str | None):
            raise ValueError(f"{name} must be a string, got {getattr(args, name)!r}")
    if args.cpu_offload_gb != 0:
        raise ValueError(
            f"cpu_offload_gb {args.cpu_offload_gb!r} is not supported: the weights stay on "
            f"{args.device} (leave it 0)"
        )
    for name in ("pipeline_parallel_size", "data_parallel_size"):
        size = getattr(args, name)
        if size != 1:
            raise ValueError(
                f"{name} {size!r} is not supported: pagedkv runs one engine, split across "
                "devices by tensor_parallel_size only (leave it 1)"
            )
    compilation = args.compilation_config
    if isinstance(compilation, str):
        compilation = (
            int(compilation)
            if compilation.isdigit()
            else json_object("compilation_config", compilation)
        )
    if not isinstance(compilation, int | dict | None) or isinstance(compilation, bool):
        raise ValueError(f"compilation_config must be a level (int) or a dict, got {compilation!r}")
    args.compilation_config = compilation
    _check_runtime_keywords(args)
    if args.logprobs_mode != "raw_logprobs":
        raise ValueError(
            f"logprobs_mode {args.logprobs_mode!r} is not supported: logprobs are the model's "
            "own, before penalties, temperature and top-k/top-p (vLLM's 'raw_logprobs')"
        )
    _check_structured_outputs(args)


def _check_runtime_keywords(args: Any) -> None:
    """vLLM's task, implementation and process settings: what pagedkv does passes, the rest
    is refused with what pagedkv does instead."""
    for name in ("task", "runner"):
        if getattr(args, name) not in ("auto", "generate"):
            raise ValueError(
                f"{name} {getattr(args, name)!r} is not supported: pagedkv runs generative "
                "(causal LM) models only (auto or generate)"
            )
    if args.model_impl not in ("auto", "vllm"):
        raise ValueError(
            f"model_impl {args.model_impl!r} is not supported: each family runs pagedkv's own "
            "implementation (auto or vllm)"
        )
    backend = args.distributed_executor_backend
    if backend not in (None, "mp") and not (backend == "uni" and args.tensor_parallel_size == 1):
        raise ValueError(
            f"distributed_executor_backend {backend!r} is not supported: tensor-parallel ranks "
            "are processes spawned on this machine (mp; uni at tensor_parallel_size 1), or "
            "started by `pagedkv worker` under torchrun"
        )
    for name, what in (
        ("skip_tokenizer_init", "the engine detokenizes its outputs"),
        ("enable_sleep_mode", "the engine keeps its weights and KV pool until shut down"),
    ):
        if getattr(args, name):
            raise ValueError(f"{name} is not supported: {what} (leave it False)")
    if not isinstance(args.max_seq_len_to_capture, int) or isinstance(
        args.max_seq_len_to_capture, bool
    ):
        raise ValueError(
            f"max_seq_len_to_capture must be an integer, got {args.max_seq_len_to_capture!r}"
        )


def _check_structured_outputs(args: Any) -> None:
    """vLLM's structured-output settings: its switches, and any backend it names, which
    pagedkv notes and holds outputs with llguidance (vLLM's "guidance") all the same: the
    constraints mean the same whichever library applies them."""
    config = json_object("structured_outputs_config", args.structured_outputs_config) or {}
    unknown = sorted(set(config) - set(_STRUCTURED_SWITCHES) - {"backend"})
    if unknown:
        raise ValueError(
            f"structured_outputs_config: {', '.join(map(repr, unknown))} not taken (it takes "
            f"backend, {', '.join(_STRUCTURED_SWITCHES)})"
        )
    for switch in _STRUCTURED_SWITCHES:
        if not isinstance(config.get(switch, False), bool):
            raise ValueError(f"structured_outputs_config: {switch} must be true or false")
    args.structured_outputs_config = config
    backend = config.get("backend", args.guided_decoding_backend) or "auto"
    if backend not in STRUCTURED_BACKENDS:
        raise ValueError(
            f"structured outputs backend {backend!r} is not one of vLLM's "
            f"({', '.join(STRUCTURED_BACKENDS)})"
        )
    if backend not in ("auto", "guidance"):
        print(
            f"structured outputs: held by llguidance (vLLM's 'guidance'), not {backend!r}, "
            "with the same constraints",
            file=sys.stderr,
        )
