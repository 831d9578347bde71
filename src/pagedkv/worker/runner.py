"""ModelRunner: executes one scheduled step on tensors: memory plan, forward pass, logits.

The scheduler decides; the runner owns the model and the KV cache tensors and does what the
`SchedulerOutput` says, in order: run the step's memory plan (copy-on-write copies and swaps,
as one ordered plan), then one flat forward pass over every scheduled chunk, then return the
logits of the chunks that end at a sequence's last token (the ones that sample).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.model.decoder import DecoderModel
from pagedkv.worker.kv_cache import KVCache
from pagedkv.worker.step import SchedulerOutput


class ModelRunner:
    """A model and its paged KV cache, advanced one scheduled step at a time."""

    def __init__(self, model: DecoderModel, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.cache.device
        self.forward_seconds = 0.0  # time inside plan + forward, for the outside-forward share
        self.model_seconds = 0.0  # time inside the model's forward alone
        self.last_num_seqs = 0  # sequences in the last forward pass (0: the step ran none)

    def execute(self, output: SchedulerOutput) -> Tensor | None:
        """Run the plan and the forward pass; float32 logits of the sampling chunks, in order.

        None when no chunk samples (nothing scheduled, or only prompt chunks mid-prompt).
        """
        started = time.perf_counter()
        self.kv_cache.execute(output.plan)
        if not output.chunks:
            self.forward_seconds += time.perf_counter() - started
            self.last_num_seqs = 0
            return None
        batch = ForwardBatch.build(
            [
                SequenceInput(chunk.token_ids, chunk.num_computed, chunk.block_table)
                for chunk in output.chunks
            ],
            self.kv_cache.block_size,
            device=self.device,
        )
        model_started = time.perf_counter()
        logits = self.model(batch, self.kv_cache)
        self.model_seconds += time.perf_counter() - model_started
        self.last_num_seqs = batch.num_seqs
        rows = [index for index, chunk in enumerate(output.chunks) if chunk.sample]
        if len(rows) < len(output.chunks):  # prompt chunks that do not reach the end
            logits = logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.forward_seconds += time.perf_counter() - started
        return logits if rows else None
