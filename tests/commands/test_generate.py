"""`pagedkv generate` through the command line's `main()`, against transformers on a tiny model.

Prompts are tokenised and chat templates rendered by transformers, completions computed by
transformers' greedy `generate`: the command's output must be their decoded text.
"""

from __future__ import annotations

import argparse
import re

import pytest
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


def greedy_text(zoo, hf_tokenizer, prompt_ids: list[int], max_tokens: int) -> tuple[str, str]:
    """transformers' greedy completion of `prompt_ids` as text (less a last character the ids
    leave incomplete, which vLLM's detokenizers never emit), and its finish reason."""
    new_ids = zoo.hf_greedy("llama", tuple(prompt_ids), max_tokens)
    finish = "stop" if new_ids[-1] == EOS else "length"
    return hf_tokenizer.decode(new_ids, skip_special_tokens=True).rstrip("\ufffd"), finish


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
    """`--speculative-config` (vLLM's JSON), n-gram and draft model: transformers' greedy text;
    a bad config exits 2 naming what is wrong."""
    prompt_ids = hf_tokenizer(PROMPT)["input_ids"]
    text, _ = greedy_text(zoo, hf_tokenizer, prompt_ids, 16)
    model = str(zoo.folder("llama"))
    argv = ["generate", "--model", model, "--prompt", PROMPT, "--max-tokens", "16", *ENGINE_FLAGS]
    for spec in (
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
        f'{{"model": "{model}", "num_speculative_tokens": 2}}',
    ):
        assert main([*argv, "--speculative-config", spec]) == 0
        out, err = capsys.readouterr()
        assert out == text + "\n" and "speculative decoding: " in err
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
    assert "pagedkv generate: --system needs --chat" in capsys.readouterr().err


def test_a_bad_sampling_value_exits_2_naming_it(zoo, capsys):
    argv = ["generate", "--model", str(zoo.folder("llama")), "--prompt", PROMPT]
    assert main([*argv, "--top-p", "1.5"]) == 2
    assert "pagedkv generate: top_p must be in [0.0, 1.0], got 1.5" in capsys.readouterr().err


def test_every_sampling_flag_reaches_its_sampling_parameter():
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(
        ["--prompt", "x", "--n", "3", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "7"]
        + ["--min-p", "0.05", "--repetition-penalty", "1.2", "--presence-penalty", "0.3"]
        + ["--frequency-penalty", "-0.4", "--max-tokens", "11", "--min-tokens", "2"]
        + ["--stop", "ab", "--stop", "c", "--stop-token-ids", "5", "6", "--ignore-eos"]
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
    )
    defaults = sampling_params_from_args(parser.parse_args(["--prompt", "x"]))
    assert defaults == SamplingParams(temperature=0.0, max_tokens=256)  # greedy by default


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


def test_a_given_pool_size_is_kept(zoo, capsys):
    argv = ["generate", "--model", str(zoo.folder("llama")), "--prompt", PROMPT]
    assert main([*argv, "--max-tokens", "4", *ENGINE_FLAGS]) == 0
    assert _pool_blocks(capsys.readouterr().err) == 32
