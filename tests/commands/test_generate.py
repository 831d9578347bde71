"""`pagedkv generate` through the command line's `main()`, against transformers on a tiny model.

Prompts are tokenised and chat templates rendered by transformers, completions computed by
transformers' greedy `generate`: the command's output must be their decoded text.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

from pagedkv.cli import main
from pagedkv.commands import generate
from pagedkv.commands.sampling_args import sampling_params_from_args
from pagedkv.engine import SamplingParams

PROMPT = "Paged attention stores keys and values"
ENGINE_FLAGS = ["--num-gpu-blocks", "32", "--swap-space-gb", "0"]
EOS = 2


@pytest.fixture(scope="module")
def hf_tokenizer(zoo):
    return transformers.AutoTokenizer.from_pretrained(zoo.folder("llama"))


def greedy_text(
    zoo, hf_tokenizer, prompt_ids: list[int], max_tokens: int, skip_special_tokens: bool = True
) -> tuple[str, str]:
    """transformers' greedy completion of `prompt_ids` as text (less a last character the ids
    leave incomplete, which vLLM's detokenizers never emit), and its finish reason."""
    new_ids = zoo.hf_greedy("llama", tuple(prompt_ids), max_tokens)
    finish = "stop" if new_ids[-1] == EOS else "length"
    text = hf_tokenizer.decode(new_ids, skip_special_tokens=skip_special_tokens)
    return text.rstrip("\ufffd"), finish


def test_generate_prints_the_greedy_completion_of_a_prompt(zoo, hf_tokenizer, capsys):
    prompt_ids = hf_tokenizer(PROMPT)["input_ids"]
    text, finish = greedy_text(zoo, hf_tokenizer, prompt_ids, 12)
    argv = ["generate", "--model", str(zoo.folder("llama")), "--prompt", PROMPT]
    assert main([*argv, "--max-tokens", "12", *ENGINE_FLAGS]) == 0
    out, err = capsys.readouterr()
    assert out == text + "\n"
    assert f"finish: {finish}]" in err


def test_generate_answers_a_chat_message_through_the_chat_template(zoo, hf_tokenizer, capsys):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello world!"},
    ]
    rendered = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    prompt_ids = hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    text, _ = greedy_text(zoo, hf_tokenizer, prompt_ids, 10)
    argv = ["generate", "--model", str(zoo.folder("llama")), "--chat", "Hello world!"]
    argv += ["--system", "You are terse.", "--max-tokens", "10", *ENGINE_FLAGS]
    assert main(argv) == 0
    assert capsys.readouterr().out == text + "\n"


def test_generate_prints_each_of_n_samples_whole(zoo, capsys):
    argv = ["generate", "--model", str(zoo.folder("llama")), "--prompt", PROMPT, "--n", "2"]
    argv += ["--temperature", "1.0", "--max-tokens", "6", "--ignore-eos", *ENGINE_FLAGS]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    [_, first, second] = re.split(r"^--- sample \d \(length\) ---\n", out, flags=re.MULTILINE)
    assert re.findall(r"^--- sample (\d) ", out, flags=re.MULTILINE) == ["0", "1"]
    assert first.strip() and second.strip() and first != second
    assert err.splitlines()[-1].startswith("[12 tokens in ")


def test_speculative_decoding_from_the_command_line_prints_the_same_completion(
    zoo, hf_tokenizer, capsys
):
    """`--speculative-config` (vLLM's JSON), n-gram and draft model: transformers' greedy text,
    and the figures line gives the acceptance rate and mean accepted length (the model drafting
    for itself keeps every draft); a bad config exits 2 naming what is wrong."""
    prompt_ids = hf_tokenizer(PROMPT)["input_ids"]
    text, _ = greedy_text(zoo, hf_tokenizer, prompt_ids, 16)
    model = str(zoo.folder("llama"))
    argv = ["generate", "--model", model, "--prompt", PROMPT, "--max-tokens", "16", *ENGINE_FLAGS]
    figures = re.compile(
        r"; speculative decoding: (\d+) verifications of (\d+) drafted tokens; acceptance rate "
        r"([\d.]+)%, mean accepted length ([\d.]+)\]$"
    )
    ngram = "speculative decoding: ngram (prompt lookup of 1-1 tokens), 3 drafts"
    json_form = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    dotted = [  # vLLM's dotted form of the same
        *("--speculative-config.method", "ngram", "--speculative_config.num_speculative_tokens"),
        *("3", "--speculative-config.prompt_lookup_min=1"),
    ]
    for spec, startup in (
        (["--speculative-config", json_form], ngram),
        (dotted, ngram),
        (["--speculative-config", f'{{"model": "{model}", "num_speculative_tokens": 2}}'], ""),
    ):
        assert main([*argv, *spec]) == 0
        out, err = capsys.readouterr()
        assert out == text + "\n" and "speculative decoding: " in err and startup in err
    drafts, draft_tokens, rate, mean = figures.search(err.splitlines()[-1]).groups()
    assert int(drafts) > 0 and rate == "100.0"
    assert float(mean) == pytest.approx(1 + int(draft_tokens) / int(drafts), abs=0.005)
    assert main([*argv, "--speculative-config", '{"method": "medusa"}']) == 2
    assert "method 'medusa' is not supported" in capsys.readouterr().err


def test_a_prompt_that_is_not_utf8_exits_2_naming_the_byte(zoo, capsys):
    """argv holds bytes that were not UTF-8 as surrogates (Python's surrogateescape)."""
    argv = ["generate", "--model", str(zoo.folder("llama")), "--max-tokens", "2"]
    for flag in ("--prompt", "--chat"):
        assert main([*argv, flag, "bad \udcff bytes"]) == 2
        assert "not valid UTF-8: byte 0xff" in capsys.readouterr().err.splitlines()[-1]


def test_a_system_message_without_a_chat_message_is_refused(zoo, capsys):
    argv = ["generate", "--model", str(zoo.folder("llama")), "--prompt", PROMPT]
    assert main([*argv, "--system", "Be brief."]) == 2
    assert "pagedkv generate: error: --system needs --chat" in capsys.readouterr().err


def test_every_sampling_flag_reaches_its_sampling_parameter():
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(
        ["--prompt", "x", "--n", "3", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "7"]
        + ["--min-p", "0.05", "--repetition-penalty", "1.2", "--presence-penalty", "0.3"]
        + ["--frequency-penalty", "-0.4", "--max-tokens", "11", "--min-tokens", "2"]
        + ["--stop", "ab", "--stop", "c", "--stop-token-ids", "5", "6", "--ignore-eos"]
        + ["--no-skip-special-tokens", "--include-stop-str-in-output", "--bad-words", "x"]
        + ["--bad-words", "y z", "--truncate-prompt-tokens", "5"]
    )
    assert sampling_params_from_args(args) == SamplingParams(
        n=3,
        temperature=0.8,
        top_p=0.9,
        top_k=7,
        min_p=0.05,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=-0.4,
        max_tokens=11,
        min_tokens=2,
        stop=["ab", "c"],
        stop_token_ids=[5, 6],
        ignore_eos=True,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        bad_words=["x", "y z"],
        truncate_prompt_tokens=5,
    )
    defaults = sampling_params_from_args(parser.parse_args(["--prompt", "x"]))
    assert defaults == SamplingParams(temperature=0.0, max_tokens=256)  # greedy by default
    # a field left unset takes the model's generation config; a typed one wins over it
    model = {"temperature": 0.7, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 9}
    typed = parser.parse_args(["--prompt", "x", "--top-k", "7", "--temperature", "0"])
    assert sampling_params_from_args(typed, model) == SamplingParams(
        temperature=0.0, top_k=7, repetition_penalty=1.05, max_tokens=9
    )
    # -1 (all the context holds) reaches SamplingParams as a value, not as a flag.
    flags = ["--prompt", "x", "--skip-special-tokens", "--truncate-prompt-tokens", "-1"]
    assert sampling_params_from_args(parser.parse_args(flags)) == SamplingParams(
        temperature=0.0, max_tokens=256, skip_special_tokens=True, truncate_prompt_tokens=-1
    )


def test_no_skip_special_tokens_prints_the_special_tokens_generated(zoo, hf_tokenizer, capsys):
    """The greedy completion of PROMPT generates BOS (`<s>`) mid-text."""
    prompt_ids = hf_tokenizer(PROMPT)["input_ids"]
    argv = ["generate", "--model", str(zoo.folder("llama")), "--prompt", PROMPT]
    argv += ["--max-tokens", "24", *ENGINE_FLAGS]
    for flags, skip in (([], True), (["--no-skip-special-tokens"], False)):
        assert main([*argv, *flags]) == 0
        text, _ = greedy_text(zoo, hf_tokenizer, prompt_ids, 24, skip_special_tokens=skip)
        assert capsys.readouterr().out == text + "\n"
    with_special, _ = greedy_text(zoo, hf_tokenizer, prompt_ids, 24, skip_special_tokens=False)
    assert with_special != greedy_text(zoo, hf_tokenizer, prompt_ids, 24)[0]  # one to show


def test_bad_words_are_never_completed(zoo, hf_tokenizer, capsys):
    """Two words of the greedy completion, banned: transformers' greedy `generate` with the
    same words' ids as `bad_words_ids` (each alone and after a space, vLLM's rule) is the
    oracle, and the banned ids occur in the completion without the flag only."""
    prompt_ids = hf_tokenizer(PROMPT)["input_ids"]
    plain = zoo.hf_greedy("llama", tuple(prompt_ids), 16)
    pieces = [hf_tokenizer.decode([token]).strip() for token in plain]
    words = [piece for piece in pieces if piece.isalpha()][:2]
    banned = [
        hf_tokenizer(spelling, add_special_tokens=False)["input_ids"]
        for word in words
        for spelling in (word, " " + word)
    ]
    with torch.no_grad():
        out = zoo.hf("llama").generate(
            torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False, bad_words_ids=banned
        )
    constrained = out[0, len(prompt_ids) :].tolist()
    assert len(words) == 2 and any(_contains(plain, ids) for ids in banned)
    assert not any(_contains(constrained, ids) for ids in banned)

    argv = ["generate", "--model", str(zoo.folder("llama")), "--prompt", PROMPT]
    argv += ["--max-tokens", "16", *ENGINE_FLAGS]
    assert main([*argv, "--bad-words", words[0], "--bad-words", words[1]]) == 0
    expected = hf_tokenizer.decode(constrained, skip_special_tokens=True).rstrip("\ufffd")
    assert capsys.readouterr().out == expected + "\n"


def _contains(token_ids: list[int], word: list[int]) -> bool:
    return any(token_ids[start : start + len(word)] == word for start in range(len(token_ids)))


def test_include_stop_str_in_output_keeps_the_stop_string(zoo, hf_tokenizer, capsys):
    """The stop string is the first two letters in a row of the plain greedy completion: the
    output ends just before it, or with it under the flag."""
    prompt_ids = hf_tokenizer(PROMPT)["input_ids"]
    text, _ = greedy_text(zoo, hf_tokenizer, prompt_ids, 16)
    stop = re.search(r"[A-Za-z]{2}", text)
    argv = ["generate", "--model", str(zoo.folder("llama")), "--prompt", PROMPT]
    argv += ["--max-tokens", "16", "--stop", stop[0], *ENGINE_FLAGS]
    for flags, end in (([], stop.start()), (["--include-stop-str-in-output"], stop.end())):
        assert main([*argv, *flags]) == 0
        out, err = capsys.readouterr()
        assert out == text[:end] + "\n"
        assert "finish: stop]" in err


def test_truncate_prompt_tokens_completes_the_prompts_last_tokens(zoo, hf_tokenizer, capsys):
    prompt_ids = hf_tokenizer(PROMPT)["input_ids"]
    text, _ = greedy_text(zoo, hf_tokenizer, prompt_ids[-10:], 12)
    assert text != greedy_text(zoo, hf_tokenizer, prompt_ids, 12)[0]  # the cut shows
    argv = ["generate", "--model", str(zoo.folder("llama")), "--prompt", PROMPT]
    argv += ["--max-tokens", "12", "--truncate-prompt-tokens", "10", *ENGINE_FLAGS]
    assert main(argv) == 0
    assert capsys.readouterr().out == text + "\n"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
        (
            ["--truncate-prompt-tokens", "0"],
            "truncate_prompt_tokens must be an integer >= 1 or -1, got 0",
        ),
        (
            ["--truncate-prompt-tokens", "-2"],
            "truncate_prompt_tokens must be an integer >= 1 or -1, got -2",
        ),
        (
            ["--truncate-prompt-tokens", "2000"],
            "truncate_prompt_tokens is 2000, greater than max_model_len (1024)",
        ),
        (["--bad-words", " "], "bad_words must not be blank, got ' '"),
    ],
)
def test_a_bad_sampling_value_is_one_line_naming_it_and_exit_2(zoo, capsys, flags, message):
    argv = ["generate", "--model", str(zoo.folder("llama")), "--prompt", PROMPT, *ENGINE_FLAGS]
    assert main([*argv, *flags]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(f"pagedkv generate: error: {message}")
    assert "Traceback" not in err


def _pool_blocks(stderr: str) -> int:
    return int(re.search(r"KV cache: (\d+) blocks", stderr)[1])


@pytest.mark.parametrize(("max_tokens", "n"), [(12, 1), (40, 3)])
def test_without_a_pool_size_the_pool_holds_what_the_request_can_need(
    zoo, hf_tokenizer, capsys, max_tokens, n
):
    prompt_len = len(hf_tokenizer(PROMPT)["input_ids"])
    argv = ["generate", "--model", str(zoo.folder("llama")), "--prompt", PROMPT]
    argv += ["--max-tokens", str(max_tokens), "--n", str(n), "--temperature", "0.8"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    # Each sample: its prompt and output in 16-token blocks, plus one block of lookahead.
    assert _pool_blocks(err) == n * (-(-(prompt_len + max_tokens) // 16) + 1)
    assert re.search(r"loaded in [\d.]+ s: kernels [\d.]+ s, weights [\d.]+ s, KV pool", err)


def test_the_pool_holds_the_prompt_as_truncation_leaves_it(zoo, capsys):
    argv = ["generate", "--model", str(zoo.folder("llama")), "--prompt", PROMPT * 8]
    assert main([*argv, "--max-tokens", "6", "--truncate-prompt-tokens", "10"]) == 0
    assert _pool_blocks(capsys.readouterr().err) == -(-(10 + 6) // 16) + 1


def test_a_given_pool_size_is_kept(zoo, capsys):
    argv = ["generate", "--model", str(zoo.folder("llama")), "--prompt", PROMPT]
    assert main([*argv, "--max-tokens", "4", *ENGINE_FLAGS]) == 0
    assert _pool_blocks(capsys.readouterr().err) == 32


def test_the_models_generation_config_sets_what_no_flag_gives(zoo, hf_tokenizer, capsys, tmp_path):
    """As `LLM.generate` and a server request: generation_config.json's `max_new_tokens` is
    the completion's length unless `--max-tokens` is typed, and `--override-generation-config`
    goes over the file; each printed completion is transformers' greedy one of that length."""
    folder = shutil.copytree(zoo.folder("llama"), tmp_path / "llama")
    config_path = folder / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config_path.write_text(json.dumps({**config, "max_new_tokens": 5}))
    prompt_ids = hf_tokenizer(PROMPT)["input_ids"]
    argv = ["generate", "--model", str(folder), "--prompt", PROMPT, *ENGINE_FLAGS]
    for flags, length in (
        ([], 5),
        (["--max-tokens", "7"], 7),
        (["--override-generation-config", '{"max_new_tokens": 3}'], 3),
    ):
        assert main([*argv, *flags]) == 0
        out, err = capsys.readouterr()
        text, finish = greedy_text(zoo, hf_tokenizer, prompt_ids, length)
        assert (out, finish) == (text + "\n", "length")
        assert f"[{length} tokens in" in err


def test_a_reader_that_stops_early_ends_the_command_quietly(zoo):
    """`pagedkv generate ... | head -c 5`: the command stops once its output has no reader,
    with no traceback, as Unix tools do (exit status 1)."""
    command = [sys.executable, "-m", "pagedkv.cli", "generate", "--model", str(zoo.folder("llama"))]
    command += ["--prompt", PROMPT, "--max-tokens", "600", "--ignore-eos"]  # the pool fits
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(child.stdout.read(5)) == 5
    child.stdout.close()
    stderr = child.communicate(timeout=120)[1].decode()
    assert child.returncode == 1
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
