"""llguidance against xgrammar on the built-in model's vocabulary: what each costs per token.

Three figures per engine installed in the running interpreter:
- compile: a 20-field JSON schema compiled for the 49,152-token vocabulary, cold (no cache);
  for llguidance, the matcher's construction plus its first mask (it builds lexer states
  lazily, so the first mask carries part of the compile);
- mask per token at batch 1: one matcher walks a valid instance of the schema token by token,
  computing the mask before each token and then accepting it;
- mask per token at batch 32: 32 matchers walk it in lockstep, their masks computed together
  each step by the engine's batched call (llguidance's thread pool, xgrammar's
  BatchGrammarMatcher), reported per row.
JSON is compact (", " and ": ", no free whitespace) for both, as the engine asks of llguidance.

xgrammar needs transformers, triton and more at run time, so it is never a pagedkv
dependency: install it in a throwaway venv with only torch (and llguidance, to compare in one
process), dump the vocabulary from pagedkv's venv first, then run there:

  .venv/bin/python bench/grammar_engines.py --dump-vocab /tmp/vocab.json
  python3 -m venv /tmp/xgvenv && /tmp/xgvenv/bin/pip install <torch 2.13.0 CPU wheel>
  /tmp/xgvenv/bin/pip install xgrammar llguidance numpy
  /tmp/xgvenv/bin/python bench/grammar_engines.py --vocab /tmp/vocab.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from importlib.util import find_spec
from typing import Any

import numpy as np

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        **{f"name_{i}": {"type": "string", "maxLength": 16} for i in range(4)},
        **{f"count_{i}": {"type": "integer", "minimum": 0, "maximum": 1000} for i in range(4)},
        **{f"flag_{i}": {"type": "boolean"} for i in range(3)},
        **{f"kind_{i}": {"enum": ["alpha", "beta", "gamma"]} for i in range(3)},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "point": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"],
        },
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "note": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
        "level": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "additionalProperties": False,
}
SCHEMA["required"] = list(SCHEMA["properties"])
INSTANCE = {
    **{f"name_{i}": f"item number {i}" for i in range(4)},
    **{f"count_{i}": 17 * (i + 1) for i in range(4)},
    **{f"flag_{i}": i % 2 == 0 for i in range(3)},
    **{f"kind_{i}": ["alpha", "beta", "gamma"][i] for i in range(3)},
    "code": "ABC-1234",
    "tags": ["red", "green"],
    "point": {"x": 1.5, "y": -2.25},
    "score": 0.75,
    "note": None,
    "level": 3,
}
BATCH = 32


def dump_vocab(path: str, model: str) -> None:
    """The model's token bytes, special and EOS ids, and the instance's tokens, as JSON."""
    from pagedkv.engine.token_bytes import TokenBytes
    from pagedkv.weights.load import load

    loaded = load(model, device="cpu")
    tokenizer, vocab_size = loaded.tokenizer, loaded.config.vocab_size
    token_bytes = TokenBytes(tokenizer)
    vocab = {
        "tokens": [token_bytes(i).hex() for i in range(vocab_size)],
        "special": sorted(token_bytes.special_ids),
        "eos": list(tokenizer.eos_token_ids),
        "instance": tokenizer.encode(json.dumps(INSTANCE), add_special_tokens=False),
        "tokenizer_json": tokenizer.tokenizer.to_str(),
    }
    with open(path, "w", encoding="utf-8") as file:
        json.dump(vocab, file)


def timed(function: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = function()
    return time.perf_counter() - started, result


def bench_llguidance(vocab: dict[str, Any]) -> dict[str, float]:
    import llguidance
    import llguidance.numpy

    tokens = [bytes.fromhex(t) or f"<|unused_{i}|>".encode() for i, t in enumerate(vocab["tokens"])]
    special = sorted(set(vocab["special"]) | {i for i, t in enumerate(vocab["tokens"]) if not t})

    from tokenizers import Tokenizer

    text_tokenizer = Tokenizer.from_str(vocab["tokenizer_json"])

    class Vocabulary:
        """What TokenizerWrapper reads (as the engine's `grammar.vocabulary` builds it)."""

        eos_token_id = vocab["eos"][0]
        bos_token_id = None
        special_token_ids = special

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: bytes) -> list[int]:
            decoded = text.decode("utf-8", "replace")
            return text_tokenizer.encode(decoded, add_special_tokens=False).ids

    wrapper = llguidance.TokenizerWrapper(Vocabulary())
    tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=len(tokens), eos_token=vocab["eos"])
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=options)
    executor = llguidance.LLExecutor()

    def compile_once() -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        mask = llguidance.numpy.allocate_token_bitmask(1, len(tokens))
        llguidance.numpy.fill_next_token_bitmask_par(executor, [(matcher, 0)], mask)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    compile_s, _ = timed(compile_once)

    def walk(batch: int) -> float:
        matchers = [llguidance.LLMatcher(tokenizer, grammar, log_level=0) for _ in range(batch)]
        mask = llguidance.numpy.allocate_token_bitmask(batch, len(tokens))
        pairs = [(matcher, row) for row, matcher in enumerate(matchers)]
        spent = 0.0
        for token in vocab["instance"]:
            started = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask_par(executor, pairs, mask)
            spent += time.perf_counter() - started
            assert mask[0, token // 32] >> (token % 32) & 1, "the instance's token is masked"
            for matcher in matchers:
                assert matcher.consume_token(token), matcher.get_error()
        return spent / (len(vocab["instance"]) * batch)

    return {"compile_ms": compile_s * 1e3, "b1_us": walk(1) * 1e6, "b32_us": walk(BATCH) * 1e6}


def bench_xgrammar(vocab: dict[str, Any]) -> dict[str, float]:
    import xgrammar

    tokens = [bytes.fromhex(t) for t in vocab["tokens"]]
    info = xgrammar.TokenizerInfo(
        tokens, xgrammar.VocabType.RAW, vocab_size=len(tokens), stop_token_ids=vocab["eos"]
    )
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile_once() -> Any:
        return compiler.compile_json_schema(SCHEMA, any_whitespace=False, separators=(", ", ": "))

    compile_s, compiled = timed(compile_once)
    batcher = xgrammar.BatchGrammarMatcher()

    def walk(batch: int) -> float:
        matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch)]
        mask = np.asarray(xgrammar.allocate_token_bitmask(batch, len(tokens)))
        spent = 0.0
        for token in vocab["instance"]:
            started = time.perf_counter()
            if batch == 1:
                matchers[0].fill_next_token_bitmask(mask, 0)
            else:
                batcher.batch_fill_next_token_bitmask(matchers, mask)
            spent += time.perf_counter() - started
            assert mask[0, token // 32] >> (token % 32) & 1, "the instance's token is masked"
            for matcher in matchers:
                assert matcher.accept_token(token)
        return spent / (len(vocab["instance"]) * batch)

    return {"compile_ms": compile_s * 1e3, "b1_us": walk(1) * 1e6, "b32_us": walk(BATCH) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", help="vocabulary JSON written by --dump-vocab")
    parser.add_argument("--dump-vocab", metavar="PATH", help="write the vocabulary and stop")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    if args.dump_vocab:
        dump_vocab(args.dump_vocab, args.model)
        return
    if not args.vocab:
        args.vocab = "/tmp/pagedkv-vocab.json"
        dump_vocab(args.vocab, args.model)
    with open(args.vocab, encoding="utf-8") as file:
        vocab = json.load(file)
    print(f"{len(vocab['tokens'])} tokens; instance of {len(vocab['instance'])} tokens")
    print(f"{'engine':<11} {'compile ms':>10} {'mask us/token b1':>17} {'b32':>9}")
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        if find_spec(name) is None:
            print(f"{name:<11} not installed")
            continue
        result = bench(vocab)
        print(
            f"{name:<11} {result['compile_ms']:>10.1f} {result['b1_us']:>17.1f}"
            f" {result['b32_us']:>9.1f}"
        )


if __name__ == "__main__":
    main()
