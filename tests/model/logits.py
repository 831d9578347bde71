"""Prompt logits of a saved folder, ours and transformers' (the oracle), for one-off models a
test builds beside the zoo's."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.model.decoder import DecoderModel
from pagedkv.worker.kv_cache import KVCache

BLOCK_SIZE = 16


def our_prompt_logits(model: DecoderModel, token_ids: list[int]) -> torch.Tensor:
    """Our logits `[len, vocab]` at every position of one prefill."""
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    cache = KVCache.for_model(model, block_size=BLOCK_SIZE, num_blocks=num_blocks)
    sequence = SequenceInput(token_ids, 0, list(range(num_blocks)), num_logits=len(token_ids))
    return model(ForwardBatch.build([sequence], BLOCK_SIZE), cache)


def hf_prompt_logits(folder: Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits `[len, vocab]` of the folder's model, without a cache."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(torch.tensor([token_ids])).logits[0]
