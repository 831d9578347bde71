"""The LoRA adapters a server serves, by the name clients pass as `model` (vLLM's way).

`serve --enable-lora --lora-modules name=path ...` names adapters at start; with
`--allow-runtime-lora-updating` (or vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`),
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter
{"lora_name"}` add and remove them while serving. Each name gets its own `LoRARequest` id. An
adapter is read and checked against the model when it is named (a bad one is a 400 naming it,
or an error at start), so a request for it never fails later for that reason; a request for a
name nobody serves is OpenAI's 404. `/v1/models` lists the adapters after the base model.
"""

from __future__ import annotations

import os
from pathlib import Path

from pagedkv.engine.lora import LoRARequest
from pagedkv.model.config import ModelConfig
from pagedkv.server.errors import APIError
from pagedkv.weights.lora import AdapterError, read_adapter

RUNTIME_UPDATING_VARIABLE = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(flag: bool) -> bool:
    """The flag, or vLLM's environment variable set to true."""
    return flag or os.environ.get(RUNTIME_UPDATING_VARIABLE, "").lower() in ("1", "true")


def parse_lora_module(text: str) -> tuple[str, str]:
    """`name=path` of `--lora-modules`; a ValueError names what is wrong."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes name=path, got {text!r}")
    return name, path


class ServedAdapters:
    """Adapter names -> their `LoRARequest`s, checked against the served model."""

    def __init__(
        self, model_name: str, config: ModelConfig, enabled: bool, max_lora_rank: int
    ) -> None:
        self.model_name = model_name
        self.config = config
        self.enabled = enabled
        self.max_lora_rank = max_lora_rank
        self.by_name: dict[str, LoRARequest] = {}
        self._next_id = 1

    def add(self, name: str, path: str) -> LoRARequest:
        """Serve the PEFT folder `path` as `name`; an APIError (400) says why it cannot be."""
        if not self.enabled:
            raise APIError(400, "LoRA adapters need a server started with --enable-lora")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise APIError(400, "lora_name and lora_path must be non-empty strings")
        if name == self.model_name or name in self.by_name:
            raise APIError(400, f"the name '{name}' is already served", param="lora_name")
        try:
            read_adapter(Path(path), name, self.config, self.max_lora_rank)
        except AdapterError as error:
            raise APIError(400, str(error), param="lora_path") from None
        lora = LoRARequest(name, self._next_id, str(Path(path).resolve()))
        self._next_id += 1
        self.by_name[name] = lora
        return lora

    def remove(self, name: str) -> None:
        """Stop serving `name` (requests already running finish with it); 404 if unknown."""
        if self.by_name.pop(name, None) is None:
            raise APIError(
                404,
                f"no LoRA adapter '{name}' is served",
                param="lora_name",
                code="model_not_found",
            )

    def request_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model (or no name); 404
        for a name nobody serves."""
        if not model or model == self.model_name:
            return None
        lora = self.by_name.get(model)
        if lora is None:
            adapters = f" and the LoRA adapters {sorted(self.by_name)}" if self.by_name else ""
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server runs '{self.model_name}'"
                + adapters,
                param="model",
                code="model_not_found",
            )
        return lora
