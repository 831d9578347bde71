"""The LoRA adapters a server serves, by the name clients pass as `model` (vLLM's way).

`serve --enable-lora --lora-modules name=path ...` names adapters at start (or, as vLLM's,
`'{"name": ..., "path": ..., "base_model_name": ...}'`, the last listed as the parent); with
`--allow-runtime-lora-updating` (or vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`),
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter
{"lora_name"}` add and remove them while serving. Each name gets its own `LoRARequest` id. The
engine reads and checks an adapter when it is named (`Engine.add_lora`, the same check a
request's adapter gets; a bad one is a 400 naming it, or an error at start). The engine keeps
at most `max_cpu_loras` adapters' weights and reads a forgotten one again when a request names
it, so only a folder changed or removed since can still make that request a 400. A request for
a name nobody serves is OpenAI's 404.
`/v1/models` lists the adapters after the base model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pagedkv.engine.lora import LoRARejected, LoRARequest
from pagedkv.server.errors import APIError

RUNTIME_UPDATING_VARIABLE = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(flag: bool) -> bool:
    """The flag, or vLLM's environment variable set to true."""
    return flag or os.environ.get(RUNTIME_UPDATING_VARIABLE, "").lower() in ("1", "true")


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter served from the start (vLLM's name): its `model` name, its PEFT folder, and
    the base model `/v1/models` lists as its parent (None: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """One `--lora-modules` value: `name=path`, or vLLM's JSON object with "name", "path" and
    an optional "base_model_name"; a ValueError names what is wrong."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--lora-modules {text!r} is not valid JSON: {error}") from None
        unknown = set(spec) - {"name", "path", "base_model_name"}
        values = [spec.get("name"), spec.get("path")]
        base = spec.get("base_model_name")
        if unknown or not all(isinstance(v, str) and v for v in values) or base == "":
            raise ValueError(
                'a --lora-modules object takes "name" and "path" (non-empty strings) and '
                f'optionally "base_model_name", got {text!r}'
            )
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules base_model_name must be a string, got {base!r}")
        return LoRAModulePath(spec["name"], spec["path"], base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes name=path or a JSON object, got {text!r}")
    return LoRAModulePath(name, path)


class ServedAdapters:
    """Adapter names -> their `LoRARequest`s."""

    def __init__(self, model_name: str, aliases: tuple[str, ...] = ()) -> None:
        self.model_name = model_name
        self.aliases = aliases  # other names of the base model (vLLM's extra served names)
        self.by_name: dict[str, LoRARequest] = {}
        self._next_id = 1

    def new(self, name: object, path: object, base_model_name: str | None = None) -> LoRARequest:
        """The request that would serve PEFT folder `path` (made absolute; a Hub repo id as
        given) as `name`, with an id of its own; an APIError (400) when the name or path cannot
        be used. The engine checks the adapter itself (`rejected` turns its refusal into a
        400); `serve` then serves it."""
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise APIError(400, "lora_name and lora_path must be non-empty strings")
        self._check_free(name)
        folder = str(Path(path).resolve()) if Path(path).exists() else path
        lora = LoRARequest(name, self._next_id, folder, base_model_name=base_model_name)
        self._next_id += 1
        return lora

    def serve(self, lora: LoRARequest) -> None:
        """Serve `lora` under its name (still free: another load may have taken it since)."""
        self._check_free(lora.lora_name)
        self.by_name[lora.lora_name] = lora

    def remove(self, name: object) -> LoRARequest:
        """Stop serving `name` (requests already running finish with it) and return its
        request; 400 without a name, 404 for one nobody serves."""
        if not isinstance(name, str) or not name:
            raise APIError(400, "lora_name must be a non-empty string", param="lora_name")
        lora = self.by_name.pop(name, None)
        if lora is None:
            raise APIError(
                404,
                f"no LoRA adapter '{name}' is served",
                param="lora_name",
                code="model_not_found",
            )
        return lora

    def request_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model (or no name); 404
        for a name nobody serves."""
        if not model or model == self.model_name or model in self.aliases:
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
        if name == self.model_name or name in self.aliases or name in self.by_name:
            raise APIError(400, f"the name '{name}' is already served", param="lora_name")


def rejected(error: LoRARejected) -> APIError:
    """The engine's refusal of an adapter as a 400 naming it."""
    return APIError(400, str(error), param="lora_path")
