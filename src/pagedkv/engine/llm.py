"""LLM: vLLM's offline API over the engine: `LLM(model).generate(prompts, SamplingParams())`.

A vLLM user changes one import. `generate` queues every prompt (if one is rejected, the ones
queued before it are aborted, so a bad prompt leaves nothing behind), steps the engine until
all finish, and returns whole outputs in input order.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.engine import Engine
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.hub import DEFAULT_MODEL
from pagedkv.tokenizer import Tokenizer

Prompt = str | Sequence[int]
Conversation = Sequence[Mapping[str, Any]]


class LLM:
    """A model served by an in-process engine, for batch generation."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        self.engine = Engine(EngineArgs(model=str(model), **engine_args))
        self._request_ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (encode, decode, chat template)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (a string, a list of strings, or lists of token ids).

        `priority` gives one priority per prompt, as vLLM's does; it needs the engine's
        `scheduling_policy="priority"` (lower runs first).
        """
        prompt_list = _as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompt_list))
        priorities = _priority_per_prompt(priority, len(prompt_list))
        return self._run(prompt_list, params, use_tqdm, priorities)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Answer one conversation or several, each rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        tokenizer = self.engine.tokenizer
        prompts: list[Prompt] = [
            tokenizer.encode_chat(conversation, add_generation_prompt)
            for conversation in conversations  # type: ignore[union-attr]
        ]
        params = _params_per_prompt(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm, [0] * len(prompts))

    def _run(
        self,
        prompts: Sequence[Prompt],
        params: list[SamplingParams],
        use_tqdm: bool,
        priorities: list[int],
    ) -> list[RequestOutput]:
        engine = self.engine
        request_ids = [str(next(self._request_ids)) for _ in prompts]
        added: list[str] = []
        try:
            for request_id, prompt, request_params, priority in zip(
                request_ids, prompts, params, priorities, strict=True
            ):
                engine.add_request(request_id, prompt, request_params, priority=priority)
                added.append(request_id)
        except Exception:
            for request_id in added:
                engine.abort(request_id)
            engine.step()  # reports the aborts; this engine runs nothing else
            raise
        results: dict[str, RequestOutput] = {}
        progress = _Progress(len(prompts), enabled=use_tqdm)
        num_finished = 0
        while num_finished < len(prompts):
            try:
                deltas = engine.step()
            except Exception:
                for request_id in request_ids:  # leave nothing of this call behind
                    engine.abort(request_id)
                engine.step()
                progress.close()
                raise
            for delta in deltas:
                whole = results.setdefault(delta.request_id, _empty_like(delta))
                _accumulate(whole, delta)
                if delta.finished:
                    num_finished += 1
                    progress.advance()
        progress.close()
        return [results[request_id] for request_id in request_ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams() for _ in range(num_prompts)]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(
            f"sampling_params has {len(params)} entries for {num_prompts} prompts; "
            "give one SamplingParams or one per prompt"
        )
    return params


def _priority_per_prompt(priority: Sequence[int] | None, num_prompts: int) -> list[int]:
    if priority is None:
        return [0] * num_prompts
    priorities = list(priority)
    if len(priorities) != num_prompts:
        raise ValueError(
            f"priority has {len(priorities)} entries for {num_prompts} prompts; give one per prompt"
        )
    return priorities


def _empty_like(delta: RequestOutput) -> RequestOutput:
    return RequestOutput(
        request_id=delta.request_id,
        prompt=delta.prompt,
        prompt_token_ids=delta.prompt_token_ids,
        outputs=[],
        finished=False,
        metrics=delta.metrics,
    )


def _accumulate(whole: RequestOutput, delta: RequestOutput) -> None:
    """Add a step's delta to the request's whole output (samples kept in index order)."""
    by_index = {output.index: output for output in whole.outputs}
    for piece in delta.outputs:
        output = by_index.get(piece.index)
        if output is None:
            output = CompletionOutput(index=piece.index, text="", token_ids=[])
            if piece.logprobs is not None:
                output.logprobs = []
            by_index[piece.index] = output
        output.text += piece.text
        output.token_ids.extend(piece.token_ids)
        if piece.logprobs is not None and output.logprobs is not None:
            output.logprobs.extend(piece.logprobs)
        output.cumulative_logprob = piece.cumulative_logprob
        output.finish_reason = piece.finish_reason
        output.stop_reason = piece.stop_reason
    whole.outputs = [by_index[index] for index in sorted(by_index)]
    whole.finished = delta.finished
    whole.metrics = delta.metrics


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
