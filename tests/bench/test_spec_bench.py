"""`bench/spec_bench.py`'s workloads: passages of the stated size from the standard library,
deterministic typos, and as many chat prompts as asked for (the timing runs are not tests)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from pagedkv.tokenizer import Tokenizer

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load_spec_bench():
    sys.path.insert(0, str(BENCH))  # it imports its sibling peers.py, as when run from bench/
    try:
        spec = importlib.util.spec_from_file_location("bench_spec_bench", BENCH / "spec_bench.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


spec_bench = _load_spec_bench()


def test_passages_have_200_to_400_tokens_and_prompts_are_chats(zoo) -> None:
    tokenizer = Tokenizer.from_folder(zoo.folder("llama"))
    passages = spec_bench.passages(tokenizer)
    low, high = spec_bench.PASSAGE_TOKENS
    assert len(passages) >= 8
    for passage in passages:
        assert low <= len(tokenizer.encode(passage, add_special_tokens=False)) <= high
    prompts = spec_bench.workloads(tokenizer, 7)
    assert [len(prompts["a"]), len(prompts["b"])] == [7, 7]
    assert prompts["a"][0] == tokenizer.encode_chat(
        [{"role": "user", "content": spec_bench.TASKS[0].format(passage=passages[0])}]
    )


def test_typos_are_deterministic_swaps_that_keep_every_word() -> None:
    text = "Deterministic typographical mistakes replace letters within longer words only " * 4
    once, again = spec_bench.with_typos(text, 3), spec_bench.with_typos(text, 3)
    assert once == again and once != text
    pairs = list(zip(once.split(" "), text.split(" "), strict=True))
    assert all(sorted(a) == sorted(b) for a, b in pairs)  # letters swapped, none lost
