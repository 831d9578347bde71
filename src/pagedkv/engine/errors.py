"""Why the engine refused a request; each message names the value and the limit.

All derive from `RequestRejected`, a `ValueError`, so a server maps every one to HTTP 400.
A rejected request is never queued: the other requests are unaffected.

`STARTUP_ERRORS` are what building an engine raises for a bad flag, model name or file; each
command prints one as a single line.
"""

from __future__ import annotations

from pagedkv.model.errors import ModelError

STARTUP_ERRORS = (ValueError, ModelError, OSError)


class RequestRejected(ValueError):
    """Base of every reason a request is refused at `add_request`. `param` names the input
    at fault (a SamplingParams field, or `prompt`) where there is one, so a server can report
    it as OpenAI's error `param`."""

    param: str | None = None


class EmptyPrompt(RequestRejected):
    """The prompt has no tokens."""

    param = "prompt"

    def __init__(self) -> None:
        super().__init__("the prompt is empty: it must have at least one token")


class TokenOutOfVocabulary(RequestRejected):
    """A token id in the prompt (or in stop_token_ids) is outside the model's vocabulary."""

    def __init__(self, token_id: int, vocab_size: int, where: str = "prompt token id") -> None:
        super().__init__(f"{where} {token_id} is outside the model's vocabulary [0, {vocab_size})")
        self.param = where.split()[0]  # "prompt", "stop_token_ids", ...


class InvalidTokenId(RequestRejected):
    """A prompt given as token ids holds something that is not an integer."""

    param = "prompt"

    def __init__(self, position: int, value: object) -> None:
        super().__init__(
            f"prompt token at position {position} is {type(value).__name__} {value!r}, "
            "expected an int"
        )


class PromptTooLong(RequestRejected):
    """The prompt fills the model's context, leaving no room for output."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"prompt has {num_prompt_tokens} tokens, model allows {max_model_len} "
            "(max_model_len), leaving no room for output"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class TruncationTooLong(RequestRejected):
    """truncate_prompt_tokens keeps more tokens than the model's context holds (vLLM refuses
    it too: the prompt it keeps could never run)."""

    param = "truncate_prompt_tokens"

    def __init__(self, keep: int, max_model_len: int) -> None:
        super().__init__(
            f"truncate_prompt_tokens is {keep}, greater than max_model_len ({max_model_len}): "
            "choose a smaller truncation size (or -1, as many as the context holds)"
        )


class RequestTooLarge(RequestRejected):
    """The request needs more KV blocks than the whole pool holds, so it could never run."""

    def __init__(self, needed_blocks: int, num_gpu_blocks: int) -> None:
        super().__init__(
            f"request needs up to {needed_blocks} KV blocks, the whole pool has "
            f"{num_gpu_blocks}: raise num_gpu_blocks / kv_cache_memory or lower max_tokens or n"
        )


class TooManySamples(RequestRejected):
    """The request's samples could never all run in one step."""

    param = "n"

    def __init__(self, n: int, limit: int, beams: bool = False) -> None:
        asked = f"a beam search of {n} beams" if beams else f"n is {n}"
        super().__init__(
            f"{asked}, but one step runs at most {limit} sequences, and a request's samples "
            "run together (max_num_seqs / max_num_batched_tokens)"
        )


class TooManyLogprobs(RequestRejected):
    """The request asks for more logprobs per token than the engine's max_logprobs."""

    def __init__(
        self, name: str, logprobs: int, max_logprobs: int, every_token: bool = False
    ) -> None:
        asked = f"{name}=-1 (every token: {logprobs})" if every_token else f"{name} is {logprobs}"
        remedy = "max_logprobs=-1" if every_token else "raise max_logprobs"
        super().__init__(
            f"{asked}, but the engine allows at most {max_logprobs} (max_logprobs; "
            f"{remedy} when starting the engine)"
        )
        self.param = name  # the SamplingParams field: logprobs or prompt_logprobs


class DuplicateRequest(RequestRejected):
    """A request with this id is already in the engine."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in use")


class InvalidPriority(RequestRejected):
    """A request's priority is not an integer."""

    param = "priority"

    def __init__(self, priority: object) -> None:
        super().__init__(f"priority is {type(priority).__name__} {priority!r}, expected an int")


class InvalidCacheSalt(RequestRejected):
    """A request's cache_salt is not a non-empty string (vLLM's rule)."""

    param = "cache_salt"

    def __init__(self, cache_salt: object) -> None:
        super().__init__(
            f"cache_salt is {type(cache_salt).__name__} {cache_salt!r}, expected a non-empty str"
        )


class PriorityNotSupported(RequestRejected):
    """A request has a priority, but the engine schedules first come, first served."""

    param = "priority"

    def __init__(self, priority: int, policy: str) -> None:
        super().__init__(
            f"priority is {priority}, but scheduling_policy is {policy!r}: only 'priority' "
            "scheduling orders requests by priority (give priority 0, or start the engine "
            "with scheduling_policy='priority')"
        )


class StepFailed(RuntimeError):
    """A step raised; the requests it was running were aborted, the others are untouched."""

    def __init__(self, request_ids: list[str], error: Exception) -> None:
        self._cause = f"{type(error).__name__}: {error}"
        super().__init__(
            f"engine step failed ({self._cause}); aborted "
            f"{len(request_ids)} request(s) it was running: {', '.join(request_ids)}"
        )
        self.request_ids = request_ids

    def message_for(self, request_id: str) -> str:
        """What the owner of one aborted request is told: the others' ids are not theirs."""
        return f"engine step failed ({self._cause}); request {request_id} was aborted"


class InvalidStructuredOutput(RequestRejected):
    """A request's structured output (JSON schema, regex, choice, grammar) does not compile."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"structured_outputs.{kind} is invalid: {reason.strip()}")
        self.kind = kind
        self.reason = reason.strip()
        self.param = "structured_outputs"
