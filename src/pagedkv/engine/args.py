"""EngineArgs: every knob of an engine, shared by `LLM(...)`, the commands and the server.

Command-line flags mirror the field names (`num_gpu_blocks` -> `--num-gpu-blocks`), as vLLM's
do, and are generated from this one dataclass so the Python and command-line spellings
cannot drift apart. vLLM's names for settings we already had are accepted too: `swap_space`
for `swap_space_gb`, `num_gpu_blocks_override` for `num_gpu_blocks` and
`kv_cache_memory_bytes` for `kv_cache_memory`; when given, vLLM's
name wins (a command may set our name's default and a user pass vLLM's flag), and it is
written into our name, which the engine reads. vLLM's keywords that mean nothing new here are
checked in `vllm_keywords.py`. Past 400 lines as one module: it is that one dataclass, every
field checked beside the others, and the flags generated from it.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pagedkv.engine.args_help import FIELD_HELP, human_readable_int
from pagedkv.engine.generation_defaults import sampling_defaults
from pagedkv.engine.profiler_config import ProfilerConfig
from pagedkv.engine.sched.config import SchedulerConfig
from pagedkv.engine.sched.policy import SCHEDULING_POLICIES
from pagedkv.engine.spec.config import SpeculativeConfig
from pagedkv.engine.vllm_keywords import check_vllm_keywords, json_object
from pagedkv.hf_cache import pinned_revision
from pagedkv.hub import BUILTIN_MODELS, DEFAULT_MODEL
from pagedkv.kvmath.spec import KV_CACHE_DTYPES
from pagedkv.quant.schemes import QUANTIZATIONS, resolve_quantization
from pagedkv.worker.kv_request import PoolRequest
from pagedkv.worker.parallel.messages import LoadSpec

# vLLM's dtype spellings -> the dtype loaded; "auto" is resolved by device (see resolved_dtype).
DTYPE_SPELLINGS = {
    "auto": None,
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
PREEMPTION_MODES = ("swap", "recompute")
# On/off fields: a --flag and a --no-flag each.
_BOOLEAN_FIELDS = (
    "enable_prefix_caching",
    "enable_lora",
    "trust_remote_code",
    "enforce_eager",
    "enable_chunked_prefill",
    "disable_log_stats",
    "disable_custom_all_reduce",
    "async_scheduling",
    "skip_tokenizer_init",
    "enable_sleep_mode",
)


@dataclass
class EngineArgs:
    """Model, memory and scheduling settings of one engine (vLLM's names)."""

    model: str = DEFAULT_MODEL
    block_size: int | None = 16  # None, vLLM's default: 16
    num_gpu_blocks: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_memory: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    swap_space_gb: float = 1.0
    swap_space: float | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int | None = 256  # None, vLLM's default: 256
    max_num_batched_tokens: int | None = 2048  # None, vLLM's default: 2048
    max_model_len: int | None = None
    preemption_mode: str | None = None
    scheduling_policy: str = "fcfs"
    dtype: str = "auto"
    device: str = "cpu"
    seed: int | None = 0  # None: 0, as vLLM's V1 engine takes it
    gpu_memory_utilization: float = 0.9
    max_logprobs: int = 20
    quantization: str = "auto"
    threads: int | None = None
    kv_offloading_size: float = 0.0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    speculative_config: SpeculativeConfig | dict | str | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    trust_remote_code: bool = False
    enforce_eager: bool = False
    enable_chunked_prefill: bool = True
    disable_log_stats: bool = False
    tokenizer: str | None = None
    generation_config: str = "auto"
    hf_overrides: dict[str, Any] | str | None = None
    override_generation_config: dict[str, Any] | str | None = None
    download_dir: str | None = None
    load_format: str = "auto"
    tokenizer_mode: str = "auto"
    revision: str | None = None
    tokenizer_revision: str | None = None
    cpu_offload_gb: float = 0.0
    compilation_config: int | dict[str, Any] | str | None = None
    structured_outputs_config: dict[str, Any] | str | None = None
    logprobs_mode: str = "raw_logprobs"
    guided_decoding_backend: str | None = None
    task: str = "auto"
    runner: str = "auto"
    model_impl: str = "auto"
    distributed_executor_backend: str | None = None
    disable_custom_all_reduce: bool = False
    max_seq_len_to_capture: int = 8192
    async_scheduling: bool = False
    skip_tokenizer_init: bool = False
    enable_sleep_mode: bool = False
    hf_token: str | None = None
    profiler_config: ProfilerConfig | dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        if self.seed is None:
            self.seed = 0
        # vLLM's defaults of these are None (detect from the checkpoint; prefix caching and
        # chunked prefill on; its block size and batch limits), and its dtype may be a
        # torch.dtype: the same settings here.
        if self.quantization is None:
            self.quantization = "auto"
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = True
        if self.enable_chunked_prefill is None:
            self.enable_chunked_prefill = True
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is None:  # vLLM's "pick for me": this engine's default
                setattr(self, name, type(self).__dataclass_fields__[name].default)
        if not isinstance(self.dtype, str) and str(self.dtype).startswith("torch."):
            self.dtype = str(self.dtype).removeprefix("torch.")
        if not isinstance(self.generation_config, str | os.PathLike):
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a folder, "
                f"got {self.generation_config!r}"
            )
        self.generation_config = str(self.generation_config)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in _BOOLEAN_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str | os.PathLike):
            raise ValueError(f"tokenizer must be a path or a model name, got {self.tokenizer!r}")
        if self.download_dir is not None:
            if not isinstance(self.download_dir, str | os.PathLike):
                raise ValueError(f"download_dir must be a folder, got {self.download_dir!r}")
            self.download_dir = str(self.download_dir)
        if self.num_gpu_blocks_override is not None:
            self.num_gpu_blocks = self.num_gpu_blocks_override
        if self.kv_cache_memory_bytes is not None:
            self.kv_cache_memory = self.kv_cache_memory_bytes
        if self.swap_space is not None:
            _gib("swap_space", self.swap_space)
            self.swap_space_gb = self.swap_space
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "tensor_parallel_size",
            "max_loras",
            "max_lora_rank",
        ):
            _positive_int(name, getattr(self, name))
        if self.max_logprobs != -1:  # vLLM's -1: no cap
            _positive_int("max_logprobs", self.max_logprobs, also=" or -1 (no cap)")
        for name in (
            "num_gpu_blocks",
            "kv_cache_memory",
            "max_model_len",
            "threads",
            "max_cpu_loras",
        ):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.num_gpu_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give at most one of num_gpu_blocks and kv_cache_memory")
        _gib("swap_space_gb", self.swap_space_gb)
        _gib("kv_offloading_size", self.kv_offloading_size)
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError(
                "kv_offloading_size is the prefix cache's host tier: it needs "
                "enable_prefix_caching (or leave it 0)"
            )
        if self.preemption_mode not in (None, *PREEMPTION_MODES):
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES} or None, "
                f"got {self.preemption_mode!r}"
            )
        if self.preemption_mode == "swap" and self.swap_space_gb == 0:
            raise ValueError("preemption_mode 'swap' needs swap_space_gb > 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        resolve_quantization(self.quantization, self.device)
        if self.tensor_parallel_size > 1 and self.device not in ("cpu", "cuda"):
            raise ValueError(
                f"device must be 'cpu' or 'cuda' with tensor_parallel_size "
                f"{self.tensor_parallel_size} (each rank takes its LOCAL_RANK's GPU), "
                f"got {self.device!r}"
            )
        _check_device(self.device)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.dtype not in DTYPE_SPELLINGS:
            raise ValueError(f"dtype must be one of {tuple(DTYPE_SPELLINGS)}, got {self.dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        self.hf_overrides = json_object("hf_overrides", self.hf_overrides)
        self.override_generation_config = json_object(
            "override_generation_config", self.override_generation_config
        )
        check_vllm_keywords(self)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.profiler_config = ProfilerConfig.parse(self.profiler_config)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The speculative decoding settings, checked (None: off)."""
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def profiler(self) -> ProfilerConfig:
        """The step profiler's settings, checked (profiler None: off)."""
        return ProfilerConfig.parse(self.profiler_config)

    @property
    def resolved_preemption_mode(self) -> str:
        """swap when swap space is configured, else recompute, unless set explicitly."""
        if self.preemption_mode is not None:
            return self.preemption_mode
        return "swap" if self.swap_space_gb > 0 else "recompute"

    @property
    def resolved_dtype(self) -> str:
        """The dtype loaded: float32, bfloat16 or float16. "auto" is float32 on a CPU (fast
        and exact there) and bfloat16 on a GPU, where checkpoints are mostly trained in it."""
        resolved = DTYPE_SPELLINGS[self.dtype]
        if resolved is None:
            return "float32" if self.device == "cpu" else "bfloat16"
        return resolved

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's settings, preemption mode resolved."""
        speculative = self.speculative
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            preemption_mode=self.resolved_preemption_mode,  # type: ignore[arg-type]
            policy=self.scheduling_policy,
            num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
        )

    def pool_request(self, max_model_len: int) -> PoolRequest:
        """How the KV pool is sized, once the model's context length is known."""
        return PoolRequest(
            block_size=self.block_size,
            swap_space_gb=self.swap_space_gb,
            num_gpu_blocks=self.num_gpu_blocks,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_offloading_size=self.kv_offloading_size,
            host_ranks=self.tensor_parallel_size,
        )

    def sampling_defaults(self, model_path: Path) -> dict[str, Any]:
        """SamplingParams keywords the model at `model_path` recommends (`generation_config`),
        with `override_generation_config` over them."""
        return sampling_defaults(
            self.generation_config, model_path, self.override_generation_config
        )

    def load_spec(self) -> LoadSpec:
        """What every rank loads (each its shard under tensor parallelism): a model named by
        Hub repo id at the commit its revision names now, so that ranks that load it later read
        one snapshot even if a branch moves meanwhile."""
        revision = self.revision
        if self.model not in BUILTIN_MODELS:
            revision = pinned_revision(self.model, revision, self.download_dir)
        return LoadSpec(
            model=self.model,
            dtype=self.resolved_dtype,
            device=self.device,
            quantization=self.quantization,
            threads=self.threads,
            load_format=self.load_format,
            hf_overrides=self.hf_overrides,  # type: ignore[arg-type]
            download_dir=self.download_dir,
            revision=revision,
        )

    @property
    def separate_tokenizer(self) -> str | None:
        """What the tokenizer is loaded from apart from the model (vLLM's `tokenizer`, or the
        model's own repo at `tokenizer_revision`), or None: it comes with the model."""
        if self.tokenizer is None and self.tokenizer_revision is None:
            return None
        return self.model if self.tokenizer is None else self.tokenizer

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one `--flag` per field, with the field's default and type; return `parser`
        (vLLM's examples chain it: `parser = EngineArgs.add_cli_args(parser)`)."""
        group = parser.add_argument_group("engine")
        for field in fields(cls):
            flag = cli_flag(field.name)
            default = field.default
            if field.name in _BOOLEAN_FIELDS:
                group.add_argument(
                    flag,
                    action=argparse.BooleanOptionalAction,
                    default=default,
                    help=FIELD_HELP[field.name],
                )
                continue
            kwargs: dict[str, Any] = {"default": default, "help": f"{FIELD_HELP[field.name]}"}
            if field.name == "dtype":
                kwargs["choices"] = tuple(DTYPE_SPELLINGS)
            elif field.name == "preemption_mode":
                kwargs["choices"] = PREEMPTION_MODES
            elif field.name == "scheduling_policy":
                kwargs["choices"] = SCHEDULING_POLICIES
            elif field.name == "quantization":
                kwargs["choices"] = QUANTIZATIONS
            elif field.name == "kv_cache_dtype":
                kwargs["choices"] = KV_CACHE_DTYPES
            else:
                kwargs["type"] = _CLI_TYPES.get(field.name, str)
            if default is not None:
                kwargs["help"] += " (default: %(default)s)"
            group.add_argument(flag, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The engine settings among parsed arguments (other arguments are ignored)."""
        return cls(**{field.name: getattr(args, field.name) for field in fields(cls)})


def cli_flag(field_name: str, *, negated: bool = False) -> str:
    """The command-line flag of an EngineArgs field as `add_cli_args` spells it; `negated`,
    the `--no-` form its on/off fields also take."""
    return ("--no-" if negated else "--") + field_name.replace("_", "-")


def flag_error(error: Exception) -> str:
    """A start-up error as the command line says it: a message that begins with a field's
    name begins with its flag instead (`num_gpu_blocks must be ...` reads
    `--num-gpu-blocks must be ...`), the spelling the user typed."""
    text = str(error)
    name = text.split(" ", 1)[0]
    if name in {field.name for field in fields(EngineArgs)}:
        return cli_flag(name) + text[len(name) :]
    return text


def _gib(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number >= 0 (GiB), got {value!r}")
    if not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0 (GiB), got {value!r}")


def _check_device(device: object) -> None:
    """`device` is 'cpu', 'cuda' or 'cuda:N', and a CUDA one is there; else a ValueError."""
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if device.startswith("cuda"):
        import torch  # only asked where a CUDA device is named

        index = int(device.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine's torch sees no such CUDA device")


def _positive_int(name: str, value: object, also: str = "") -> None:
    """Refuse `value` unless it is a positive int; `also` names what else the caller allows."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer{also}, got {value!r}")


_CLI_TYPES = {
    "block_size": int,
    "num_gpu_blocks": int,
    "num_gpu_blocks_override": int,
    "kv_cache_memory": int,
    "kv_cache_memory_bytes": int,
    "swap_space_gb": float,
    "swap_space": float,
    "kv_offloading_size": float,
    "threads": int,
    "max_logprobs": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": human_readable_int,
    "max_model_len": human_readable_int,
    "tensor_parallel_size": int,
    "pipeline_parallel_size": int,
    "data_parallel_size": int,
    "max_loras": int,
    "max_cpu_loras": int,
    "max_lora_rank": int,
    "seed": int,
    "cpu_offload_gb": float,
    "gpu_memory_utilization": float,
    "max_seq_len_to_capture": int,
}
