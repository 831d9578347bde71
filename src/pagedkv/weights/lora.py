"""LoRA adapters in PEFT's format: read from a folder, checked against the base model.

A PEFT LoRA folder holds `adapter_config.json` and `adapter_model.safetensors`, whose tensors
are named `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`: A is
`[rank, in_features]`, B `[out_features, rank]`, and the adapted projection computes
`x W^T + (x A^T) B^T * scaling`, `scaling = alpha / rank` (`alpha / sqrt(rank)` with
`use_rslora`). Ranks and alphas may differ per module (`rank_pattern`, `alpha_pattern`): the
rank is read from each tensor's shape, the alpha from the pattern that matches the module's
name, as PEFT matches them.

Every registry family names its projections as Llama does, so one reader serves them all: any
of q/k/v/o/gate/up/down, on any layers. What a LoRA folder can hold beyond that (adapted
embeddings or LM head, DoRA, biases, fully trained `modules_to_save`, Conv1D's transposed
weights) is refused by name, never silently dropped, and so is a shape that does not fit the
base model: an adapter trained for another model.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from pagedkv.hf_cache import HubCacheError, hub_cache, is_repo_id, snapshot, snapshot_hint
from pagedkv.kvmath import lora as lora_plan
from pagedkv.kvmath.lora import TARGETS
from pagedkv.model.config import ModelConfig
from pagedkv.model.lora import RankSlice

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


class AdapterError(ValueError):
    """A LoRA adapter that cannot be used with this model; the message names it and why."""


@dataclass(frozen=True)
class LoRAModule:
    """One adapted projection: `delta = (x A^T) B^T * scaling`."""

    a: Tensor  # float32 [rank, in_features]
    b: Tensor  # float32 [out_features, rank]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def shard(self, share: RankSlice) -> LoRAModule:
        """The module as a tensor-parallel rank keeps it: B's rows of `share.rows` (zeros past
        the part's end), A's columns of `share.columns`; itself where the share is whole."""
        out_features, in_features = self.b.shape[0], self.a.shape[1]
        whole_rows = share.rows == (0, out_features, out_features)
        whole_columns = share.columns == (0, in_features)
        if whole_rows and whole_columns:
            return self
        b, a = self.b, self.a  # a part kept whole is not copied
        if not whole_rows:
            first, count, local = share.rows
            b = self.b.new_zeros(local, self.rank)
            b[:count] = self.b[first : first + count]
        if not whole_columns:
            column, width = share.columns
            a = self.a[:, column : column + width].contiguous()
        return LoRAModule(a, b, self.scaling)


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's modules by (layer, projection name), in float32 on the host."""

    name: str
    path: Path
    modules: dict[tuple[int, str], LoRAModule]

    def shard(self, slices: Mapping[tuple[int, str], RankSlice]) -> LoRAAdapter:
        """This rank's share of every module (`model.lora.lora_slices`: as the rank keeps each
        base weight); the adapter itself in one process, where every share is whole."""
        modules = {
            key: module if key not in slices else module.shard(slices[key])
            for key, module in self.modules.items()
        }
        if all(modules[key] is module for key, module in self.modules.items()):
            return self
        return LoRAAdapter(self.name, self.path, modules)

    def layer_projections(self, num_layers: int) -> list[list[AdaptedProjection]]:
        """Per layer, its adapted projections (`kvmath.lora.PROJECTIONS` order)."""
        layers: list[list[AdaptedProjection]] = [[] for _ in range(num_layers)]
        for layer in range(num_layers):
            for parts in lora_plan.PROJECTIONS:
                present = [
                    (index, self.modules[(layer, part)])
                    for index, part in enumerate(parts)
                    if (layer, part) in self.modules
                ]
                if present:
                    layers[layer].append(AdaptedProjection(parts, present))
        return layers


@dataclass(frozen=True)
class AdaptedProjection:
    """One projection's adapted parts: per part its index among the projection's parts and its
    module."""

    parts: tuple[str, ...]
    present: list[tuple[int, LoRAModule]]

    @cached_property
    def a(self) -> Tensor:
        """The parts' A matrices stacked, `[sum of ranks, in]` (made when first written)."""
        return torch.cat([module.a for _, module in self.present])


def layer_sizes(layers: list[list[AdaptedProjection]]) -> list[list[int]]:
    """Per layer, the element counts of its matrices as they are written (stacked A, then each
    part's B): what `kvmath.lora.place` packs into pool blocks."""
    return [
        lora_plan.matrix_sizes(
            [[(m.a.shape[1], m.b.shape[0], m.rank) for _, m in p.present] for p in projections]
        )
        for projections in layers
    ]


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adaptable projection of the base model."""
    return lora_plan.projection_shapes(
        config.hidden_size,
        config.intermediate_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
    )


def read_adapter(path: str | Path, name: str, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """The adapter in PEFT folder `path` (or, as vLLM's, a Hub repo id's folder in the local
    Hugging Face cache), checked against `config` and `max_rank`."""
    folder = Path(path)
    if not folder.exists():
        try:
            folder = snapshot(str(path)) or folder
        except HubCacheError as error:  # the repo is there, not its main snapshot
            raise AdapterError(f"LoRA adapter {name!r}: {error}") from None
    if not folder.is_dir():
        in_cache = (
            f" (nor a repo in the Hugging Face cache {hub_cache()})"
            if is_repo_id(str(path))
            else ""
        )
        raise AdapterError(f"LoRA adapter {name!r}: no such folder {folder}{in_cache}")
    settings = _settings(folder, name)
    try:
        tensors = load_file(folder / WEIGHTS_FILE)
    except FileNotFoundError:
        raise AdapterError(
            f"LoRA adapter {name!r}: {folder} has no {WEIGHTS_FILE} (PEFT's format)"
            f"{snapshot_hint(folder / WEIGHTS_FILE)}"
        ) from None
    except SafetensorError as error:
        raise AdapterError(
            f"LoRA adapter {name!r}: {WEIGHTS_FILE} is unreadable: {error}"
        ) from None
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in TARGETS:
            raise AdapterError(
                f"LoRA adapter {name!r}: tensor {key} adapts no projection pagedkv supports "
                f"(LoRA on {', '.join(TARGETS)} only)"
            )
        layer = int(match.group(1))
        pairs.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor
    if not pairs:
        raise AdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    shapes = projection_shapes(config)
    modules = {}
    for (layer, target), pair in sorted(pairs.items()):
        where = f"LoRA adapter {name!r}, layer {layer} {target}"
        if layer >= config.num_layers:
            raise AdapterError(f"{where}: the base model has {config.num_layers} layers")
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: lora_{'B' if 'A' in pair else 'A'} is missing")
        a, b = pair["A"], pair["B"]
        in_features, out_features = shapes[target]
        rank = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or tuple(b.shape) != (out_features, rank):
            raise AdapterError(
                f"{where}: lora_A is {list(a.shape)} and lora_B {list(b.shape)}, the base "
                f"model's {target} needs [rank, {in_features}] and [{out_features}, rank] "
                "(an adapter for another base model?)"
            )
        if a.shape[1] != in_features:
            raise AdapterError(
                f"{where}: lora_A takes {a.shape[1]} inputs, the base model's {target} "
                f"{in_features} (an adapter for another base model?)"
            )
        if rank > max_rank:
            raise AdapterError(f"{where}: rank {rank} is above max_lora_rank {max_rank}")
        alpha = _alpha(settings, layer, target)
        scaling = alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)
        modules[(layer, target)] = LoRAModule(
            a.to(torch.float32).contiguous(), b.to(torch.float32).contiguous(), scaling
        )
    return LoRAAdapter(name, folder, modules)


def _settings(folder: Path, name: str) -> dict[str, Any]:
    """adapter_config.json, with every setting pagedkv cannot honour refused by name."""
    path = folder / CONFIG_FILE
    try:
        settings = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(
            f"LoRA adapter {name!r}: {folder} has no {CONFIG_FILE}{snapshot_hint(path)}"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AdapterError(f"LoRA adapter {name!r}: {path} is not JSON: {error}") from None
    if not isinstance(settings, dict):
        raise AdapterError(f"LoRA adapter {name!r}: {path} is not a JSON object")
    peft_type = settings.get("peft_type", "LORA")
    refused = {
        "peft_type": peft_type not in ("LORA", None),
        "use_dora": bool(settings.get("use_dora")),
        "fan_in_fan_out": bool(settings.get("fan_in_fan_out")),
        "bias": settings.get("bias", "none") not in ("none", None),
        "lora_bias": bool(settings.get("lora_bias")),
        "modules_to_save": bool(settings.get("modules_to_save")),
    }
    for key, bad in refused.items():
        if bad:
            raise AdapterError(
                f"LoRA adapter {name!r}: {key}={settings.get(key)!r} is not supported "
                "(plain LoRA on the attention and MLP projections only)"
            )
    if not isinstance(settings.get("lora_alpha", 8), (int, float)):
        raise AdapterError(f"LoRA adapter {name!r}: lora_alpha must be a number")
    return settings


def _alpha(settings: dict[str, Any], layer: int, target: str) -> float:
    """The module's alpha: the first `alpha_pattern` key matching its name, as PEFT matches
    them (the key ends the name, at a dot), else `lora_alpha` (PEFT's default 8)."""
    module_name = f"model.layers.{layer}.{_block(target)}.{target}"
    for pattern, alpha in (settings.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            return float(alpha)
    return float(settings.get("lora_alpha", 8))


def _block(target: str) -> str:
    return "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
