"""Structured outputs: a request's output held to a JSON schema, regex, choice or grammar.

`params` (the request's constraint), `grammar` (the constraint as an llguidance grammar, and
the vocabulary it masks over), `compiler` (compilation off the step loop, cached), `state`
(one sample's place in its grammar) and `mask` (the sampler's per-row token mask).
"""

from pagedkv.engine.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
