"""vLLM's `vllm.sampling_params` import path, so `from vllm.sampling_params import ...` ports by
renaming the package: the names are the engine's own (`pagedkv.engine`)."""

from pagedkv.engine.beam_search import BeamSearchParams
from pagedkv.engine.outputs import RequestOutputKind
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.structured.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = [
    "BeamSearchParams",
    "GuidedDecodingParams",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
