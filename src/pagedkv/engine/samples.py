"""A request's samples as the engine starts them: each one's tokens, seeded generator, penalty
counts, detokenizer and grammar state.

Every sample that samples draws from a stream of its own, so its tokens do not depend on
what else the engine runs or on how many drafts a step verifies. Sample i of a seeded request
takes the seed spread by a large odd stride, so the n samples differ and the request stays
reproducible. A sample of a request with no seed takes the engine's seed mixed with the
sample's number in the order samples were made (`unseeded_stream`: no two numbers below 2^32
share a stream), so an engine `seed` makes a whole run reproducible, as vLLM's does,
speculation or not. A greedy sample draws nothing and gets no generator. A request that
asked for no text (`detokenize=False`) gets no detokenizer: its samples make token ids only.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

import torch

from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.penalties import TokenCounts, uses_penalties
from pagedkv.engine.request import Sequence
from pagedkv.engine.structured.compiler import CompiledGrammar
from pagedkv.memory.tokens import SequenceTokens
from pagedkv.tokenizer import Tokenizer

# Spreads a request's seed over its samples so each sample draws its own stream.
SAMPLE_SEED_STRIDE = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class SampleFactory:
    """What every new sample of this engine needs: the tokenizer its text comes from, the
    vocabulary its penalty counts cover, the device of its generator and counts, and the
    engine's seed with the count of unseeded samples made so far."""

    tokenizer: Tokenizer
    vocab_size: int
    device: torch.device
    seed: int = 0
    _unseeded: Iterator[int] = field(default_factory=itertools.count, init=False, repr=False)

    def new(
        self,
        request_id: str,
        index: int,
        token_ids: SequenceOf[int],
        params: SamplingParams,
        grammar: CompiledGrammar | None,
    ) -> Sequence:
        """Sample `index` of request `request_id`, holding the prompt `token_ids`."""
        generator = None
        if params.seed is not None:
            seed = (params.seed + index * SAMPLE_SEED_STRIDE) % 2**64
            generator = torch.Generator(device=self.device).manual_seed(seed)
        elif not params.greedy:
            seed = unseeded_stream(self.seed, next(self._unseeded))
            generator = torch.Generator(device=self.device).manual_seed(seed)
        tokens = SequenceTokens((request_id, index), token_ids)
        counts = None
        if uses_penalties(params):
            counts = TokenCounts.for_prompt(token_ids, self.vocab_size, self.device)
        detokenizer = None
        if params.detokenize:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, tokens.token_ids, len(tokens), params.skip_special_tokens
            )
        return Sequence(
            seq_id=(request_id, index),
            index=index,
            tokens=tokens,
            num_prompt_tokens=len(tokens),
            detokenizer=detokenizer,
            generator=generator,
            counts=counts,
            grammar=None if grammar is None else grammar.new_state(),
        )


def unseeded_stream(engine_seed: int, number: int) -> int:
    """The seed of the `number`-th unseeded sample's stream under `engine_seed`: 32 bits, as
    the CPU's generator (an mt19937) keeps only the low 32 bits of a seed, so that no two
    numbers below 2^32 share a stream (a 64-bit mix cut to 32 bits would, after some 77,000
    samples, with even odds). The number, offset by a mix of the engine's seed, goes through
    murmur3's 32-bit finaliser, a bijection that scatters consecutive numbers."""
    z = (_fmix32(engine_seed % 2**32 ^ (engine_seed >> 32) % 2**32) + number) % 2**32
    return _fmix32(z)


def _fmix32(z: int) -> int:
    """murmur3's finaliser: a bijection of 32-bit integers."""
    z = ((z ^ (z >> 16)) * 0x85EBCA6B) % 2**32
    z = ((z ^ (z >> 13)) * 0xC2B2AE35) % 2**32
    return z ^ (z >> 16)
