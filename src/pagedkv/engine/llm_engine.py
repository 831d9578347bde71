"""LLMEngine: vLLM's engine-level names over `Engine`, so a vLLM `LLMEngine` loop runs as it
does there (`from pagedkv import LLMEngine, EngineArgs`).

The loop vLLM's examples write is `LLMEngine.from_engine_args(args)`, `add_request(id,
prompt, params)` with a prompt string or dict, then `step()` until
`has_unfinished_requests()` is false, printing each `RequestOutput` once it is `finished`.
That loop reads whole outputs: vLLM's `SamplingParams.output_kind` defaults to CUMULATIVE,
while `Engine.step` reports deltas. So a request added here whose params leave output_kind
unset (None) is reported CUMULATIVE, as vLLM's; a set one is honoured. `arrival_time` is
vLLM's wall-clock `time.time()`, turned into the monotonic clock the engine's latencies use.
`get_metrics()` is `LLM.get_metrics()`'s, over the requests added here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from typing import Any

from pagedkv.engine.admission import special_tokens_flag
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.beam_search import BeamSearchParams
from pagedkv.engine.engine import Engine
from pagedkv.engine.lora import LoRARequest
from pagedkv.engine.metrics import vllm_metrics
from pagedkv.engine.metrics_reader import Metric, read_metrics
from pagedkv.engine.outputs import RequestOutput, RequestOutputKind
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.prompts import PromptDict, as_prompt, prompt_text
from pagedkv.tokenizer import Tokenizer
from pagedkv.weights.load import LoadedModel


class LLMEngine(Engine):
    """`Engine` with vLLM's `LLMEngine` methods and its CUMULATIVE default."""

    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        super().__init__(args, loaded)
        self._metrics = vllm_metrics(self)

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        usage_context: object = None,
        stat_loggers: object = None,
        enable_multiprocessing: bool = False,
    ) -> LLMEngine:
        """vLLM's constructor; usage reporting, stat loggers and multiprocessing change no
        output, so they are taken and left."""
        return cls(engine_args)

    def add_request(  # type: ignore[override]  # vLLM's signature, Engine's keywords after
        self,
        request_id: str,
        prompt: str | SequenceOf[int] | PromptDict,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: Mapping[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        *,
        cache_salt: str | None = None,
        beam_search: BeamSearchParams | None = None,
    ) -> str:
        """vLLM's add_request: a prompt string, token ids or prompt dict (its `cache_salt`
        read); `arrival_time` in time.time() seconds; `tokenization_kwargs` takes
        `add_special_tokens` for a text prompt. `trace_headers` (tracing) change no output.
        Returns the request's id, as vLLM's newer ones do."""
        if not isinstance(request_id, str):  # vLLM's check: ids are reported back as strings
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        given_text = prompt_text(prompt)  # a TokensPrompt's text too, reported as given
        if isinstance(prompt, Mapping):
            cache_salt = prompt.get("cache_salt", cache_salt)
            prompt = as_prompt(prompt)
        if tokenization_kwargs:  # checked whatever the prompt; it changes only a text's ids
            add = special_tokens_flag(tokenization_kwargs)
            if isinstance(prompt, str):
                prompt = self.tokenizer.encode(prompt, add_special_tokens=add)
        params = params if params is not None else self.default_sampling_params()
        if params.output_kind is None:
            params = params.clone()
            params.output_kind = RequestOutputKind.CUMULATIVE
        if arrival_time is not None:
            arrival_time = time.monotonic() - max(0.0, time.time() - arrival_time)
        super().add_request(
            request_id,
            prompt,
            params,
            cache_salt=cache_salt,
            priority=priority,
            arrival_time=arrival_time,
            beam_search=beam_search,
            lora_request=lora_request,
        )
        if given_text is not None:
            self._requests[request_id].prompt = given_text  # reported as given, as vLLM's
        self._metrics.track(request_id, self._requests[request_id].params)
        return request_id

    def step(self) -> list[RequestOutput]:
        """`Engine.step`, its outputs observed by `get_metrics`'s histograms."""
        outputs = super().step()
        self._metrics.observe_outputs(outputs, self.last_step_iteration_tokens)
        return outputs

    def get_metrics(self) -> list[Metric]:
        """vLLM's: every metric now, under vLLM's names (see `LLM.get_metrics`)."""
        return read_metrics(self._metrics.registry)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort one request or several (vLLM's takes either)."""
        for each in [request_id] if isinstance(request_id, str) else list(request_id):
            self.abort(each)

    def has_unfinished_requests(self) -> bool:
        """vLLM's name of `has_unfinished`."""
        return self.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        """Requests not finished yet (waiting, running or swapped), aborted ones included
        until a step reports them, as `has_unfinished_requests` counts them."""
        return len(self._requests) + len(self._aborted)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (device and host tier); False while requests hold
        blocks, as vLLM's."""
        return self.manager.reset_prefix_cache()

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's: record the steps from now in a torch.profiler trace (see `LLM.start_profile`)."""
        self.profiler.start(profile_prefix)

    def stop_profile(self) -> None:
        """vLLM's: stop recording and write the trace."""
        self.profiler.stop()

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer (transformers' calls; see `pagedkv.tokenizer`)."""
        return self.tokenizer
