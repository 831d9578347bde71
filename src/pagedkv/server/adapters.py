"""The LoRA adapters a server serves, by the name clients pass as `model` (vLLM's way).

`serve --enable-lora --lora-modules name=path ...` names adapters at start; with
`--allow-runtime-lora-updating` (or vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`),
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter
{"lora_name"}` add and remove them while serving. Each name gets its own `LoRARequest` id. The
engine reads and checks an adapter when it is named (`Engine.loras.resolve`, the same check a
request's adapter gets; a bad one is a 400 naming it, or an error at start), so a request for
it never fails later for that reason; a request for a name nobody serves is OpenAI's 404.
`/v1/models` lists the adapters after the base model.
"""

from __future__ import annotations

import os
from pathlib import Path

from pagedkv.engine.lora import LoRARejected, LoRARequest
from pagedkv.server.errors import APIError

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
    """Adapter names -> their `LoRARequest`s."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.by_name: dict[str, LoRARequest] = {}
        self._next_id = 1

    def new(self, name: object, path: object) -> LoRARequest:
        """The request that would serve PEFT folder `path` as `name`, with an id of its own;
        an APIError (400) when the name or path cannot be used. The engine checks the adapter
        itself (`rejected` turns its refusal into a 400); `serve` then serves it."""
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise APIError(400, "lora_name and lora_path must be non-empty strings")
        self._check_free(name)
        lora = LoRARequest(name, self._next_id, str(Path(path).resolve()))
        self._next_id += 1
        return lora

    def serve(self, lora: LoRARequest) -> None:
        """Serve `lora` under its name (still free: another load may have taken it since)."""
        self._check_free(lora.lora_name)
        self.by_name[lora.lora_name] = lora

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

    def _check_free(self, name: str) -> None:
        if name == self.model_name or name in self.by_name:
            raise APIError(400, f"the name '{name}' is already served", param="lora_name")


def rejected(error: LoRARejected) -> APIError:
    """The engine's refusal of an adapter as a 400 naming it."""
    return APIError(400, str(error), param="lora_path")
