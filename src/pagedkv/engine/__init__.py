"""The engine: continuous batching over paged KV memory, with a vLLM-shaped API."""

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.engine import Engine
from pagedkv.engine.errors import (
    DuplicateRequest,
    EmptyPrompt,
    InvalidTokenId,
    PromptTooLong,
    RequestRejected,
    RequestTooLarge,
    StepFailed,
    TokenOutOfVocabulary,
    TooManySamples,
)
from pagedkv.engine.llm import LLM
from pagedkv.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.stats import BlockState, EngineStats, KVSnapshot

__all__ = [
    "LLM",
    "BlockState",
    "CompletionOutput",
    "DuplicateRequest",
    "EmptyPrompt",
    "Engine",
    "EngineArgs",
    "EngineStats",
    "InvalidTokenId",
    "KVSnapshot",
    "Logprob",
    "PromptTooLong",
    "RequestMetrics",
    "RequestOutput",
    "RequestRejected",
    "RequestTooLarge",
    "SamplingParams",
    "StepFailed",
    "TokenOutOfVocabulary",
    "TooManySamples",
]
