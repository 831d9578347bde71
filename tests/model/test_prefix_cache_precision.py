"""Prefix caching changes no output, in float32, bfloat16 and float16.

Each of 20 prompts runs twice: once to fill the cache, then again, so that with caching on the
second run reads every full block of its prompt from the cache and computes only the rest (one
token, through the decode path, when the prompt is one past a block boundary; up to 16, through
the prefill path with a cached prefix, otherwise). With caching off it prefills the whole
prompt. Greedy tokens and logits of the second run must not depend on which happened: in every
dtype they are identical bit for bit, since each kernel computes a row the same way whatever
the rows around it (the README's "One request, one answer").
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.memory import KVCacheManager
from pagedkv.model.decoder import DecoderModel
from pagedkv.weights.hf_folder import load_model
from pagedkv.worker.kv_cache import KVCache
from tests.model.tiny_models import random_prompt

BLOCK_SIZE = 16
NEW_TOKENS = 4
# Tokens left to compute after a hit (length - full blocks before the last token): 1 for 17,
# 33, 49, 65, 97 and 129 (the decode path), 2 to 16 for the others (prefill after a prefix).
PROMPT_LENGTHS = [17, 18, 20, 31, 32, 33, 40, 47, 49, 57, 64, 65, 70, 81, 90, 97, 100, 113, 120]
PROMPT_LENGTHS.append(129)
NUM_BLOCKS = 2 * sum(-(-(n + NEW_TOKENS) // BLOCK_SIZE) for n in PROMPT_LENGTHS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefix_caching_changes_no_token_and_no_logit(zoo, dtype: torch.dtype) -> None:
    model = load_model(zoo.folder("llama"), dtype=dtype)
    off, hits_off = second_runs(model, enable_prefix_caching=False)
    on, hits_on = second_runs(model, enable_prefix_caching=True)

    assert hits_off == [0] * len(PROMPT_LENGTHS)
    assert hits_on == [(n - 1) // BLOCK_SIZE * BLOCK_SIZE for n in PROMPT_LENGTHS]
    for n, (tokens_off, logits_off), (tokens_on, logits_on) in zip(
        PROMPT_LENGTHS, off, on, strict=True
    ):
        assert tokens_on == tokens_off, f"prompt of {n} tokens"
        assert torch.equal(logits_on, logits_off), f"prompt of {n} tokens"


def second_runs(
    model: DecoderModel, enable_prefix_caching: bool
) -> tuple[list[tuple[list[int], torch.Tensor]], list[int]]:
    """Run each prompt twice; return the second run's tokens and logits, and its cache hits."""
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, 0, enable_prefix_caching)
    cache = KVCache.for_model(model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    runs, hits = [], []
    for index, length in enumerate(PROMPT_LENGTHS):
        prompt = random_prompt(length, seed=500 + index)
        greedy(model, manager, cache, f"fill{index}", prompt, new_tokens=1)
        hits.append(manager.allocate(f"again{index}", prompt))
        runs.append(greedy(model, manager, cache, f"again{index}", prompt, hits[-1]))
    return runs, hits


def greedy(
    model: DecoderModel,
    manager: KVCacheManager,
    cache: KVCache,
    seq_id: str,
    prompt: list[int],
    num_cached: int | None = None,
    new_tokens: int = NEW_TOKENS,
) -> tuple[list[int], torch.Tensor]:
    """Generate greedily, one sequence per forward, then free; returns tokens and logits."""
    if num_cached is None:
        num_cached = manager.allocate(seq_id, prompt)
    tokens, computed = list(prompt), num_cached
    generated, all_logits = [], []
    while len(generated) < new_tokens:
        step = SequenceInput(tokens[computed:], computed, manager.block_table(seq_id))
        logits = model(ForwardBatch.build([step], BLOCK_SIZE), cache)[0]
        computed = len(tokens)
        manager.mark_computed(seq_id, computed)
        generated.append(int(logits.argmax()))
        all_logits.append(logits)
        cache.execute(manager.append(seq_id, generated[-1:]))
        tokens.append(generated[-1])
    manager.free(seq_id)
    return generated, torch.stack(all_logits)
