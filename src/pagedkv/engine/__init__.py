"""The engine: continuous batching over paged KV memory, with a vLLM-shaped API.

The names are imported on first use, so the simulator runs `engine.sched`'s scheduler without
importing torch (which `Engine` and `LLM` need).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "BlockState",
    "CompletionOutput",
    "DuplicateRequest",
    "EmptyPrompt",
    "Engine",
    "EngineArgs",
    "EngineStats",
    "GuidedDecodingParams",
    "InvalidCacheSalt",
    "InvalidPriority",
    "InvalidStructuredOutput",
    "InvalidTokenId",
    "KVSnapshot",
    "LLMEngine",
    "LoRARejected",
    "LoRARequest",
    "Logprob",
    "PriorityNotSupported",
    "PromptTooLong",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "RequestRejected",
    "RequestTooLarge",
    "SamplingParams",
    "StepFailed",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokenOutOfVocabulary",
    "TokensPrompt",
    "TooManyLogprobs",
    "TooManySamples",
    "TruncationTooLong",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'pagedkv.engine' has no attribute {name!r}")
    from pagedkv.engine import (
        args,
        beam_search,
        engine,
        errors,
        llm,
        llm_engine,
        lora,
        outputs,
        params,
        prompts,
        stats,
    )
    from pagedkv.engine.structured import params as structured

    modules = (
        args,
        beam_search,
        engine,
        errors,
        llm,
        llm_engine,
        lora,
        outputs,
        params,
        prompts,
        stats,
        structured,
    )
    module = next(m for m in modules if name in dir(m))
    return getattr(module, name)
