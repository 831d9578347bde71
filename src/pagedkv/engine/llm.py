"""LLM: vLLM's offline API over the engine: `LLM(model).generate(prompts, SamplingParams())`.

A vLLM user changes one import. `generate` reads prompts as vLLM does (text, token ids, the
`{"prompt": ...}` and `{"prompt_token_ids": [...]}` dicts), queues them, steps the engine until
all finish, and returns whole outputs in input order. A call leaves nothing behind: if a prompt
is rejected, a step fails or the user presses Ctrl-C, the call's requests are aborted; and it
collects only its own requests' outputs.

`get_metrics()` reads the engine's Prometheus metrics under vLLM's names (`vllm:...`), as
vLLM's does; its histograms observe the requests of this `LLM`'s calls.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from pagedkv.engine.admission import special_tokens_flag
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedkv.engine.engine import Engine
from pagedkv.engine.lora import LoRARequest
from pagedkv.engine.metrics import vllm_metrics
from pagedkv.engine.metrics_reader import Metric, read_metrics
from pagedkv.engine.outputs import (
    RequestOutput,
    RequestOutputKind,
    accumulate,
    empty_like,
)
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.prompts import Prompt, PromptDict, as_prompts, is_sequence
from pagedkv.hub import DEFAULT_MODEL
from pagedkv.tokenizer import Tokenizer

T = TypeVar("T")

Conversation = Sequence[Mapping[str, Any]]


class LLM:
    """A model served by an in-process engine, for batch generation."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        self.engine = Engine(EngineArgs(model=str(model), **engine_args))
        self._request_ids = itertools.count()
        self._metrics = vllm_metrics(self.engine)

    def get_metrics(self) -> list[Metric]:
        """vLLM's: every metric now, under vLLM's names (`vllm.v1.metrics.reader` types:
        Counter, Gauge, Histogram, and the accepted-tokens-per-position Vector)."""
        return read_metrics(self._metrics.registry)

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (encode, decode, chat template)."""
        return self.engine.tokenizer

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Forget every cached prefix, on the device and in the host tier, so the next call's
        prompts are computed whole (vLLM's, for benchmarks of cold prompts). True: between
        calls no request holds blocks, so vLLM's `reset_running_requests` has none to act on,
        and `reset_connector` no KV connector (pagedkv has none)."""
        return self.engine.manager.reset_prefix_cache()

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's: record the steps from now in a torch.profiler trace (`profiler_config`;
        see `engine/step_profiler.py`), its file named after `profile_prefix` when given."""
        self.engine.profiler.start(profile_prefix)

    def stop_profile(self) -> None:
        """vLLM's: stop recording and write the trace and its table to torch_profiler_dir."""
        self.engine.profiler.stop()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: the model's
        generation_config.json over SamplingParams' defaults (vLLM's; `generation_config=
        "vllm"` leaves the file out)."""
        return self.engine.default_sampling_params()

    def _params_or_defaults(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        """One SamplingParams per prompt; none given: the model's defaults for each. Each
        reports deltas, which `_run` joins into whole outputs, whatever its `output_kind`
        (vLLM's LLM returns whole outputs whatever it says too)."""
        if sampling_params is None:
            return [self.get_default_sampling_params()] * num_prompts
        return [
            params if params.output_kind in (None, RequestOutputKind.DELTA) else _as_deltas(params)
            for params in _params_per_prompt(sampling_params, num_prompts)
        ]

    def generate(
        self,
        prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
        tokenization_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (the rest keyword-only, as vLLM's): a string, token ids, a
        `{"prompt": ...}` or `{"prompt_token_ids": [...]}` dict (with an optional
        `"cache_salt"`: prefix-cache blocks are shared only between prompts with the same
        salt), or a list of them; anything else is a TypeError.

        `priority` gives one priority per prompt, as vLLM's does; it needs the engine's
        `scheduling_policy="priority"` (lower runs first). `lora_request` is one LoRA adapter
        for every prompt, or one (or None) per prompt; it needs `enable_lora=True`.
        `tokenization_kwargs` (vLLM's) takes `add_special_tokens` for text prompts.
        """
        prompt_list, salts, texts = as_prompts(prompts)
        if tokenization_kwargs:
            prompt_list = self._encoded(prompt_list, tokenization_kwargs)
        params = self._params_or_defaults(sampling_params, len(prompt_list))
        priorities = _priority_per_prompt(priority, len(prompt_list))
        loras = _lora_per_prompt(lora_request, len(prompt_list))
        options = [
            {"params": each, "priority": rank, "lora_request": lora, "cache_salt": salt}
            for each, rank, lora, salt in zip(params, priorities, loras, salts, strict=True)
        ]
        return self._run(prompt_list, options, use_tqdm, texts)

    def _encoded(self, prompts: list[Prompt], kwargs: Mapping[str, Any]) -> list[Prompt]:
        """Text prompts as token ids, encoded with `kwargs` (`add_special_tokens` only)."""
        add = special_tokens_flag(kwargs)
        encode = self.engine.tokenizer.encode
        return [encode(p, add_special_tokens=add) if isinstance(p, str) else p for p in prompts]

    def beam_search(
        self,
        prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search over each prompt (the rule: `beam_search.py`), its beams sharing
        their blocks; per prompt, the `beam_width` best beams, best first. Each beam's tokens
        start with the prompt's and keep a final EOS; its text decodes them all. Prompts and
        `lora_request` are as `generate`'s (vLLM's order of arguments); `concurrency_limit`
        searches at most that many prompts at once (None: all), as vLLM's does."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and (
            not isinstance(concurrency_limit, int)
            or isinstance(concurrency_limit, bool)
            or concurrency_limit < 1
        ):
            raise ValueError(
                f"concurrency_limit must be an integer >= 1 or None, got {concurrency_limit!r}"
            )
        prompt_list, salts, _ = as_prompts(prompts)
        loras = _lora_per_prompt(lora_request, len(prompt_list))
        # The EOS stays in the tokens, as vLLM's `LLM.beam_search` keeps it.
        whole = replace(params, include_stop_str_in_output=True)
        options = [
            {"beam_search": whole, "lora_request": lora, "cache_salt": salt}
            for lora, salt in zip(loras, salts, strict=True)
        ]
        group = concurrency_limit or max(1, len(prompt_list))
        outputs = [
            output
            for start in range(0, len(prompt_list), group)
            for output in self._run(
                prompt_list[start : start + group], options[start : start + group], use_tqdm
            )
        ]
        tokenizer = self.engine.tokenizer
        return [
            BeamSearchOutput(
                [
                    BeamSearchSequence(
                        tokens=(tokens := [*output.prompt_token_ids, *beam.token_ids]),
                        logprobs=beam.logprobs or [],
                        cum_logprob=beam.cumulative_logprob or 0.0,
                        text=tokenizer.decode(tokens, skip_special_tokens=False),
                        finish_reason=beam.finish_reason,
                        stop_reason=beam.stop_reason,  # type: ignore[arg-type]
                    )
                    for beam in output.outputs
                ]
            )
            for output in outputs
        ]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tokenization_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or several, each rendered with the model's chat template
        (or `chat_template`, given `chat_template_kwargs` as extra variables), as vLLM's.

        `continue_final_message` continues the last message instead of starting a new turn
        (it needs `add_generation_prompt=False`). `tools` (OpenAI-style function definitions)
        reach the template as its `tools` variable, as vLLM passes them; the answer is text
        (the server's chat completions parse tool calls out of it). Each output's `prompt` is
        the rendered text. `lora_request` is as `generate`'s. `chat_template_content_format`
        is vLLM's: a message's content reaches the template as one string ("string": text
        parts joined by newlines) or as a list of text parts ("openai"); "auto" picks "openai"
        for a template that loops over a message's content, as vLLM detects it.
        `tokenization_kwargs` (vLLM's) takes `add_special_tokens` for the rendered text
        (default False: the template places its special tokens).
        """
        add_special = special_tokens_flag(
            {"add_special_tokens": False, **(tokenization_kwargs or {})}
        )
        if not is_sequence(messages):
            raise TypeError(
                "messages must be a list of {'role': ..., 'content': ...} dicts, or a list of "
                f"such lists, got {type(messages).__name__}"
            )
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        tokenizer = self.engine.tokenizer
        variables = dict(chat_template_kwargs or {})
        if tools is not None:
            variables["tools"] = [dict(tool) for tool in tools]
        texts = [
            tokenizer.render_chat(
                conversation,  # type: ignore[arg-type]
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                template_kwargs=variables,
                content_format=chat_template_content_format,
            )
            for conversation in conversations
        ]
        # The template places any BOS itself, so the text is encoded without special tokens
        # unless asked.
        prompts: list[Prompt] = [
            tokenizer.encode(text, add_special_tokens=add_special) for text in texts
        ]
        params = self._params_or_defaults(sampling_params, len(prompts))
        loras = _lora_per_prompt(lora_request, len(prompts))
        options = [
            {"params": each, "lora_request": lora} for each, lora in zip(params, loras, strict=True)
        ]
        return self._run(prompts, options, use_tqdm, texts)

    def _run(
        self,
        prompts: Sequence[Prompt],
        options: Sequence[Mapping[str, Any]],
        use_tqdm: bool,
        texts: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Add the prompts, each with its `Engine.add_request` keywords (`options`), step
        until all finish, return whole outputs in order.

        `texts` are the prompts as text, also where they are given as ids (chat's rendered
        conversations, a TokensPrompt's `prompt`), reported as `RequestOutput.prompt` as vLLM
        does.
        """
        engine = self.engine
        request_ids = [str(next(self._request_ids)) for _ in prompts]
        added: list[str] = []
        try:
            for request_id, prompt, keywords in zip(request_ids, prompts, options, strict=True):
                engine.add_request(request_id, prompt, **keywords)
                added.append(request_id)
                beam = keywords.get("beam_search")
                params = beam.sampling_params(False) if beam else keywords["params"]
                self._metrics.track(request_id, params)
        except BaseException:
            self._abort(added)
            raise
        ours = set(request_ids)
        results: dict[str, RequestOutput] = {}
        progress = _Progress(len(prompts), enabled=use_tqdm)
        num_finished = 0
        try:
            while num_finished < len(prompts):
                deltas = engine.step()
                self._metrics.observe_outputs(deltas, engine.last_step_iteration_tokens)
                for delta in deltas:
                    if delta.request_id not in ours:  # someone else's, added to the engine
                        continue
                    whole = results.setdefault(delta.request_id, empty_like(delta))
                    accumulate(whole, delta)
                    if delta.finished:
                        num_finished += 1
                        progress.advance()
        except BaseException:  # a failed step, or Ctrl-C: leave nothing of this call behind
            self._abort(request_ids)
            raise
        finally:
            progress.close()
        outputs = [results[request_id] for request_id in request_ids]
        if texts is not None:
            for output, text in zip(outputs, texts, strict=True):
                output.prompt = text
        return outputs

    def _abort(self, request_ids: list[str]) -> None:
        """Abort these requests and report the aborts, so no later call sees them."""
        for request_id in request_ids:
            self.engine.abort(request_id)
        self._metrics.observe_outputs(self.engine.step(), self.engine.last_step_iteration_tokens)


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams], num_prompts: int
) -> list[SamplingParams]:
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not is_sequence(sampling_params):
        raise TypeError(
            f"sampling_params must be a SamplingParams or a list of them, got "
            f"{type(sampling_params).__name__}"
        )
    listed = _one_per_prompt("sampling_params", sampling_params, num_prompts, "one SamplingParams")
    for params in listed:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    return listed


def _as_deltas(params: SamplingParams) -> SamplingParams:
    deltas = params.clone()
    deltas.output_kind = RequestOutputKind.DELTA
    return deltas


def _priority_per_prompt(priority: Sequence[int] | None, num_prompts: int) -> list[int]:
    if priority is None:
        return [0] * num_prompts
    if not is_sequence(priority):
        raise TypeError(
            f"priority must be a list of ints, one per prompt (as vLLM's), got {priority!r}"
        )
    return _one_per_prompt("priority", priority, num_prompts)


def _lora_per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    return _one_per_prompt("lora_request", lora_request, num_prompts, "one LoRARequest for all")


def _one_per_prompt(name: str, values: Sequence[T], num_prompts: int, single: str = "") -> list[T]:
    """`values` as a list, refused (naming `name`) unless it has one entry per prompt."""
    listed = list(values)
    if len(listed) != num_prompts:
        alternative = f"{single} or " if single else ""
        raise ValueError(
            f"{name} has {len(listed)} entries for {num_prompts} prompts; give "
            f"{alternative}one per prompt"
        )
    return listed


class _Progress:
    """A rich progress bar on an interactive stderr; silent otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._progress = None
        if enabled and sys.stderr.isatty():
            from rich.progress import Progress

            self._progress = Progress(transient=True)
            self._task = self._progress.add_task("Generating", total=total)
            self._progress.start()

    def advance(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
