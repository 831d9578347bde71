"""LoRARequest: which adapter a request runs with (vLLM's class), apart from the catalog in
`lora.py`, so the outputs and requests that carry one import nothing of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request: its name, its id (>= 1, unique per adapter) and its
    PEFT folder (vLLM's fields and order); `base_model_name`, keyword-only as vLLM's
    callers pass it, is the model a server lists as the adapter's parent."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = field(default=None, kw_only=True)

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
