"""Grammar compilation off the engine's step loop, with compiled grammars cached.

`submit` checks a request's constraint at once (a bad schema is refused at `add_request`) and
queues its compilation for the vocabulary on one worker thread; llguidance releases the GIL
while it compiles, so the steps of other requests go on meanwhile. The scheduler holds a
request whose grammar is not ready out of admission (vLLM's WAITING_FOR_FSM). Compiled
grammars are kept by their constraint's text, least recently used dropped past
`CACHE_SIZE`; each sample of a request then starts from its own copy of the compiled one.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

import llguidance

from pagedkv.engine.errors import InvalidStructuredOutput
from pagedkv.engine.structured.grammar import TOO_DEEP, grammar_spec, vocabulary
from pagedkv.engine.structured.params import StructuredOutputsParams
from pagedkv.engine.structured.state import GrammarState

if TYPE_CHECKING:
    from pagedkv.tokenizer import Tokenizer

CACHE_SIZE = 256


class CompiledGrammar:
    """A grammar being compiled, or compiled: what a request's samples copy their state from."""

    def __init__(self, future: Future[llguidance.LLMatcher]) -> None:
        self._future = future

    @property
    def ready(self) -> bool:
        """True once compiled (the request may be scheduled)."""
        return self._future.done()

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for the compilation (when nothing else can run)."""
        wait_futures([self._future], timeout=timeout)

    def new_state(self) -> GrammarState:
        """A sample's state at the grammar's start (its matcher copied when first needed)."""
        return GrammarState(self.new_matcher)

    def new_matcher(self) -> llguidance.LLMatcher:
        """A matcher at the grammar's start, for one sample (blocks until compiled)."""
        return self._future.result().deep_copy()


class GrammarCompiler:
    """One worker thread compiling grammars for the model's vocabulary, and their cache."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._executor: ThreadPoolExecutor | None = None
        self._vocabulary: Future[llguidance.LLTokenizer] | None = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()

    def check(self, params: StructuredOutputsParams) -> str | None:
        """Refuse what `submit` would refuse (InvalidStructuredOutput), compiling nothing: the
        grammar `submit` would compile (None: it is cached), to hand it so it is not made
        twice."""
        return None if _key(params) in self._cache else grammar_spec(params)

    def submit(self, params: StructuredOutputsParams, spec: str | None = None) -> CompiledGrammar:
        """Check `params` now (InvalidStructuredOutput) and compile it on the worker thread,
        unless it is cached; `spec` is what `check` returned for it, if it was checked."""
        key = _key(params)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        spec = grammar_spec(params) if spec is None else spec
        if self._executor is None:  # started by the first constrained request only
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-grammar")
            self._vocabulary = self._executor.submit(vocabulary, self._tokenizer, self.vocab_size)
        assert self._vocabulary is not None
        vocab = self._vocabulary
        compiled = CompiledGrammar(self._executor.submit(_compile, vocab, spec))
        self._cache[key] = compiled
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled


def _key(params: StructuredOutputsParams) -> object:
    """The cache key of `params` (InvalidStructuredOutput for a schema nested too deep)."""
    try:
        return params.key()
    except RecursionError as error:  # a schema nested past Python's stack
        raise InvalidStructuredOutput(params.kind, TOO_DEEP) from error


def _compile(vocab: Future[llguidance.LLTokenizer], spec: str) -> llguidance.LLMatcher:
    """The matcher at the grammar's start. One that fails only against the vocabulary (the
    spec was checked without it) is in its error state: its samples end at once (`state`)."""
    return llguidance.LLMatcher(vocab.result(), spec, log_level=0)
