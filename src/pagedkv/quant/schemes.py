"""What a model may keep its weights as, and what a setting means where it runs: importable
without torch.

`resolve_quantization` is the one place `quantization` is interpreted: `EngineArgs` checks it
with the engine's device, and `weights.load` resolves it once for the model it
builds; the layers only do what the resolved value says (`assemble.build_model`).
"""

from __future__ import annotations

SCHEMES = ("int8", "int4")  # quantise every projection on load, whatever the checkpoint
QUANTIZATIONS = ("auto", "none", *SCHEMES)


def resolve_quantization(quantization: str, device: object) -> str:
    """What `quantization` means on `device` (a name or a torch.device), on every rank.

    "auto" keeps a GGUF file's quantised blocks on CPU ranks, each its shard under tensor
    parallelism; there are no GPU kernels for them yet, so on a GPU it is "none". int8 or int4
    off the CPU, or an unknown name, is an error naming why.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    on_cpu = str(device).split(":")[0] == "cpu"
    if quantization in SCHEMES and not on_cpu:
        raise ValueError(
            f"quantization {quantization!r} runs on the CPU only (there are no GPU kernels for "
            "quantised weights yet); use quantization 'none' on a GPU"
        )
    if quantization == "auto" and not on_cpu:
        return "none"
    return quantization
