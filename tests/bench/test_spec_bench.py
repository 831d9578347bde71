"""`bench/spec_bench.py`'s workloads: passages of the stated size from the standard library,
deterministic typos, and as many chat prompts as asked for (the timing runs are not tests)."""

from __future__ import annotations

from pagedkv.tokenizer import Tokenizer
from tests.bench import load_script

spec_bench = load_script("spec_bench")


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


def test_replay_bound_counts_the_steps_and_rows_of_the_lookups_drafts() -> None:
    spec = {"prompt_lookup_min": 2, "prompt_lookup_max": 4, "num_speculative_tokens": 3}
    prompt = [10, 11, 12, 13, 14, 15, 16, 17]
    # After [.., 10, 11] the lookup drafts 12, 13, 14, all kept; after [.., 14, 15] it drafts
    # 16, 17 (cut so that the step's token after them is still one the output has), of which
    # the output keeps 16; the first and last steps find no n-gram.
    output = [10, 11, 12, 13, 14, 15, 16, 99, 98]
    bound = spec_bench.replay_bound([prompt], [output], spec, (4.0, 1.0))
    # steps at 1 (no draft), 2 (3 drafts, 3 kept), 6 (2 drafts, 1 kept), 8 (no draft)
    plain, every, oracle = 8 * 5.0, 5.0 + 8.0 + 7.0 + 5.0, 5.0 + 8.0 + 6.0 + 5.0
    assert (bound.fixed, bound.per_row) == (4.0, 1.0)
    assert abs(bound.every_draft - plain / every) < 1e-12
    assert abs(bound.oracle - plain / oracle) < 1e-12
    assert bound.free_rows == 8 / 4


def test_a_llama_cpp_worker_that_dies_leaves_ours_reported(tmp_path, capsys) -> None:
    """llama.cpp runs last: if its worker dies, the run still reports pagedkv's figures (no
    llama.cpp figures) and says why, instead of losing them to a traceback."""
    crashing = tmp_path / "python"
    crashing.write_text("#!/bin/sh\nkill -s SEGV $$\n")
    crashing.chmod(0o755)
    args = spec_bench.parse_args(["--llama-python", str(crashing), "--rounds", "1"])

    class Eos:
        eos_token_ids = {2}

    figures = spec_bench.llama_figures(args, tmp_path / "model.gguf", {"a": [[1, 5, 7]]}, Eos, 1)
    assert figures is None
    out = capsys.readouterr().out
    assert "llama.cpp: failed (llama.cpp worker died of a segmentation fault" in out
    assert "DGGML_NATIVE=OFF" in out  # the rebuild that avoids the crash seen on this machine
