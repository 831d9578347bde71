"""Assemble a model from named checkpoint tensors, whatever file format they came from.

The registry names the module class of the config's architecture; the model is built directly
on the target device in the target dtype with uninitialised weights, then every checkpoint
tensor is checked against the shape the config implies and copied into its place as it
arrives, so peak memory stays near the size of the weights. Fused projections (`Linear` with
several parts) say which checkpoint tensors fill which of their rows; the model says how its
module paths are spelled in a checkpoint. Every expected tensor must arrive exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from pagedkv.model.config import ModelConfig
from pagedkv.model.decoder import DecoderModel
from pagedkv.model.errors import MalformedModelFile, MissingTensor, TensorShapeMismatch
from pagedkv.model.layers.embedding import Embedding
from pagedkv.model.layers.linear import Linear
from pagedkv.model.registry import ARCHITECTURES
from pagedkv.quant.formats import QuantizedTensor
from pagedkv.quant.quantize import GROUP_SIZE
from pagedkv.quant.schemes import resolve_quantization

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class _Slot:
    """Where one checkpoint tensor goes: a module's parameter, or one part of a fused one."""

    module: nn.Module
    param_name: str
    part: int | None  # the Linear part, None for a whole parameter
    shape: tuple[int, ...]

    def load(self, tensor: Tensor | QuantizedTensor) -> None:
        if isinstance(self.module, Embedding):
            self.module.load(tensor)
        elif self.part is not None:
            self.module.load(self.param_name, self.part, tensor)
        else:
            with torch.no_grad():
                getattr(self.module, self.param_name).copy_(tensor)

    def read(self) -> Tensor:
        if isinstance(self.module, Embedding):
            return self.module.dense_weight()
        if self.part is None:
            return getattr(self.module, self.param_name).detach()
        return self.module.part_view(self.param_name, self.part).detach()


def build_model(
    config: ModelConfig,
    tensors: Iterable[tuple[Path, str, Tensor | QuantizedTensor]],
    source: Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    quantization: str = "none",
) -> DecoderModel:
    """Assemble an eval-mode model from `(file, checkpoint name, tensor)` triples.

    Each tensor is checked against the shape `config` implies and converted on arrival, so at
    most one source tensor is held beside the model; `source` names the weights in errors.
    A tensor may arrive quantised (a GGUF file's blocks); `quantization`, as
    `quant.schemes.resolve_quantization` resolves it for `device` (the same on every rank),
    says what the model keeps: "none" float weights, "auto" quantised tensors as they came,
    "int8"/"int4" every projection and the embedding table in that layout (see
    `Linear.quantize`).
    """
    dtype = resolve_dtype(dtype)
    quantization = resolve_quantization(quantization, device)
    model_class = ARCHITECTURES[config.architecture].model_class()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(default_dtype)
    if quantization != "none":
        model.quantize(quantization)
    slots = checkpoint_slots(model)
    loaded: set[str] = set()
    for path, name, tensor in tensors:
        if model.skips_checkpoint_tensor(name):
            continue
        slot = slots.get(name)
        if slot is None:
            raise MalformedModelFile(
                path, f"unexpected tensor {name!r}: not a weight of {config.architecture}"
            )
        if tuple(tensor.shape) != slot.shape:
            raise TensorShapeMismatch(path, name, slot.shape, tuple(tensor.shape))
        if not isinstance(tensor, QuantizedTensor) and (
            not tensor.is_floating_point() or tensor.element_size() == 1
        ):
            # Casting would turn quantized (integer or fp8, stored with scales elsewhere) or
            # corrupt data into plausible-looking weights.
            raise MalformedModelFile(
                path,
                f"tensor {name!r} has dtype {str(tensor.dtype).removeprefix('torch.')}, "
                "expected a float32, bfloat16 or float16 weight (pre-quantised checkpoints "
                "are not read: load the float one, quantised here with quantization int8 or "
                "int4, or a GGUF file)",
            )
        slot.load(tensor)
        loaded.add(name)
    for name in slots:
        if name not in loaded:
            raise MissingTensor(source, name)
    if quantization in ("int8", "int4"):
        _warn_of_float_projections(model, quantization)
    return model.eval().requires_grad_(False)


def _warn_of_float_projections(model: DecoderModel, quantization: str) -> None:
    """Say which projections `quantization` could not quantise: groups of `GROUP_SIZE` inputs
    must tile a row, so a layer whose input size does not stays float (the start-up line
    counts them; this names why)."""
    kept = [m for m in model.modules() if isinstance(m, Linear) and m.kept_float]
    if kept:
        sizes = sorted({layer.in_features for layer in kept})
        logger.warning(
            "quantization %s: %d projections stay float: their input sizes %s are not "
            "multiples of %d",
            quantization,
            len(kept),
            sizes,
            GROUP_SIZE,
        )


def checkpoint_slots(model: DecoderModel) -> dict[str, _Slot]:
    """Every checkpoint tensor name `model` expects, with where it goes."""
    slots: dict[str, _Slot] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, Embedding):  # its table may be quantised: no parameter then
            name = f"{model.checkpoint_name(module_name)}.weight"
            slots[name] = _Slot(module, "weight", None, module.checkpoint_shape)
        elif isinstance(module, Linear):  # its weight may be quantised: no parameter then
            parent, _, own = module_name.rpartition(".")
            param_names = ("weight",) if module.bias is None else ("weight", "bias")
            for param_name in param_names:
                for part, part_name in enumerate(module.checkpoint_parts(own)):
                    path = f"{parent}.{part_name}" if parent else part_name
                    name = f"{model.checkpoint_name(path)}.{param_name}"
                    slots[name] = _Slot(
                        module, param_name, part, module.part_shape(param_name, part)
                    )
        else:
            for param_name, param in module.named_parameters(recurse=False):
                name = f"{model.checkpoint_name(module_name)}.{param_name}"
                slots[name] = _Slot(module, param_name, None, tuple(param.shape))
    return slots


def checkpoint_state(model: DecoderModel) -> dict[str, Tensor]:
    """The model's weights under their checkpoint names, fused projections split into their
    parts: what a Hugging Face checkpoint of this model holds (views, not copies)."""
    return {name: slot.read() for name, slot in checkpoint_slots(model).items()}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A supported weight dtype, from a torch dtype or its name."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")
        return DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype {dtype} is not supported (supported: {', '.join(DTYPES)})")
    return dtype
