"""The names of what a model may keep its weights as, importable without torch.

`EngineArgs` validates `quantization` with them, and the simulator imports `EngineArgs`
without torch; `assemble.build_model` says what each one means.
"""

from __future__ import annotations

SCHEMES = ("int8", "int4")  # quantise every projection on load, whatever the checkpoint
QUANTIZATIONS = ("auto", "none", *SCHEMES)
