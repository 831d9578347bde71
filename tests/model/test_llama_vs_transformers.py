"""Our paged model computes what transformers computes, whatever the paging does underneath.

Every tiny architecture (Llama, Llama 3 rope scaling, linear rope scaling with biases, Mistral
with a 16-token sliding window, Qwen2 with biases, tied embeddings and a windowed layer) is
checked on logits (1e-4, float32) and on greedy tokens against transformers, through prefix
cache hits, copy-on-write forks and swapping. Sequences run well past the sliding windows
(16, 24) and the Llama 3 model's 32-token pre-training context.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.model.batch import ForwardBatch, SequenceInput
from pagedkv.model.kv_cache import KVCache
from pagedkv.model.tokenizer import Tokenizer
from tests.model.greedy import GreedyRunner, decode, generate
from tests.model.tiny_models import TINY_MODELS, random_prompt

ARCHITECTURES = list(TINY_MODELS)
PROMPT_LENGTHS = [5, 17, 33, 64, 100, 150, 231, 300]
NEW_TOKENS = 16


def blocks_needed(lengths: list[int], block_size: int) -> int:
    return sum(-(-n // block_size) for n in lengths)


def eos_ids(zoo, name: str) -> tuple[int, ...]:
    """The ids that stop generation, as our tokenizer reads them from generation_config.json."""
    return Tokenizer.from_folder(zoo.folder(name)).eos_token_ids


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_logits_match_for_prefill_and_32_decode_steps(zoo, name):
    model = zoo.ours(name)
    block_size = 16
    prompt_lens = [5, 40, 90]
    sequences = [random_prompt(n, seed) for seed, n in enumerate(prompt_lens)]
    assert max(prompt_lens) + 32 > 3 * 32  # past every window and the 32-token context
    cache = KVCache.for_model(model.config, block_size=block_size, num_blocks=32)
    # Deliberately scattered, non-contiguous block tables.
    tables = [
        list(range(31 - i, -1, -3))[: -(-(n + 32) // block_size)] for i, n in enumerate(prompt_lens)
    ]
    inputs = [SequenceInput(list(s), 0, t) for s, t in zip(sequences, tables, strict=True)]
    steps = []
    for _ in range(33):  # the prefill, then 32 decode steps
        logits = model(ForwardBatch.build(inputs, block_size), cache)
        steps.append(logits)
        for seq, token in zip(sequences, logits.argmax(-1).tolist(), strict=True):
            seq.append(token)
        inputs = [
            SequenceInput([s[-1]], len(s) - 1, t) for s, t in zip(sequences, tables, strict=True)
        ]

    ours = torch.stack(steps, dim=1)  # [num_seqs, 33, vocab_size]
    for i, (seq, n) in enumerate(zip(sequences, prompt_lens, strict=True)):
        # transformers, without a cache, over the whole sequence: row p predicts token p + 1.
        expected = zoo.hf_logits(name, seq[:-1])[n - 1 :]
        torch.testing.assert_close(ours[i], expected, atol=1e-4, rtol=0, msg=f"sequence {i}")


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_batch_matches_generate(zoo, name, block_size):
    prompts = {f"req{i}": random_prompt(n, seed=100 + i) for i, n in enumerate(PROMPT_LENGTHS)}
    eos = eos_ids(zoo, name)
    num_blocks = blocks_needed([n + NEW_TOKENS for n in PROMPT_LENGTHS], block_size)
    # Prompts enter in chunks of at most 64 tokens, so most steps mix prompt chunks of the
    # long requests with decode tokens of the short ones.
    runner = GreedyRunner(
        zoo.ours(name), block_size=block_size, num_blocks=num_blocks, max_chunk=64
    )

    outputs = generate(runner, prompts, NEW_TOKENS, eos)

    for seq_id, prompt in prompts.items():
        assert outputs[seq_id] == zoo.hf_greedy(name, tuple(prompt), NEW_TOKENS), seq_id
    assert runner.manager.num_free_blocks == num_blocks


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_prefix_cache_hits_read_the_first_requests_blocks(zoo, name):
    block_size = 16
    first = random_prompt(100, seed=7)
    shares_70 = first[:70] + random_prompt(30, seed=8)
    runner = GreedyRunner(zoo.ours(name), block_size=block_size, num_blocks=64)
    runner.add("first", first)
    runner.step()  # the first prompt's KV is written and its 6 full blocks enter the cache

    assert runner.add("shares_70", shares_70) == 64
    assert runner.add("identical", list(first)) == 96  # capped: one token left to compute
    table = runner.manager.block_table("first")
    assert runner.manager.block_table("shares_70")[:4] == table[:4]
    outputs = decode(runner, ["shares_70", "identical"], NEW_TOKENS, eos_ids(zoo, name))

    assert outputs["shares_70"] == zoo.hf_greedy(name, tuple(shares_70), NEW_TOKENS)
    assert outputs["identical"] == zoo.hf_greedy(name, tuple(first), NEW_TOKENS)
    runner.free("first")
    # Freed but still cached: a later request reads blocks nobody holds any more.
    later = first[:48] + random_prompt(20, seed=9)
    assert runner.add("later", later) == 48
    assert decode(runner, ["later"], NEW_TOKENS, eos_ids(zoo, name))["later"] == zoo.hf_greedy(
        name, tuple(later), NEW_TOKENS
    )


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_forked_children_diverge_with_copy_on_write(zoo, name):
    prompt = random_prompt(37, seed=11)  # 37 % 16 != 0: the fork shares a partial block
    runner = GreedyRunner(zoo.ours(name), block_size=16, num_blocks=16)
    runner.add("parent", prompt)
    first_token = runner.step()["parent"]
    runner.fork("parent", "child")
    other_token = (first_token + 1) % zoo.ours(name).config.vocab_size

    copies = runner.append("parent", first_token) + runner.append("child", other_token)
    assert len(copies) == 1 and runner.manager.stats.cow_copies == 1
    outputs = decode(runner, ["parent", "child"], NEW_TOKENS, eos_ids(zoo, name))

    for forced, seq_id in [(first_token, "parent"), (other_token, "child")]:
        assert outputs[seq_id] == zoo.hf_greedy(name, (*prompt, forced), NEW_TOKENS), seq_id


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_swapped_out_sequence_continues_identically_after_swap_in(zoo, name):
    block_size = 8
    prompts = {"swapped": random_prompt(45, seed=21), "stays": random_prompt(30, seed=22)}
    runner = GreedyRunner(zoo.ours(name), block_size=block_size, num_blocks=24, num_cpu_blocks=12)
    for seq_id, prompt in prompts.items():
        runner.add(seq_id, prompt)
    outputs = {seq_id: [] for seq_id in prompts}
    for _ in range(5):
        for seq_id, token in runner.step().items():
            outputs[seq_id].append(token)
            runner.append(seq_id, token)

    swap_out_plan = runner.swap_out("swapped")
    # Another request takes every free block, evicting the swapped sequence's cached blocks
    # and overwriting their KV with its own.
    free = runner.manager.num_free_blocks
    runner.add("intruder", random_prompt(free * block_size, seed=23))
    runner.step(["intruder"])
    runner.free("intruder")
    swap_in_plan = runner.swap_in("swapped")

    assert len(swap_in_plan) == len(swap_out_plan) == -(-(45 + 5) // block_size)
    rest = decode(runner, list(prompts), NEW_TOKENS - 5, eos_ids(zoo, name))
    for seq_id, prompt in prompts.items():
        assert outputs[seq_id] + rest[seq_id] == zoo.hf_greedy(name, tuple(prompt), NEW_TOKENS)
