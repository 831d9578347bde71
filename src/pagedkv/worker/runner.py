"""ModelRunner: executes one scheduled step on tensors: memory plan, forward pass, logits.

The scheduler decides; the runner owns the model and the KV cache tensors and does what the
`SchedulerOutput` says, in order: forget the tables of dropped sequences and the LoRA adapters
evicted, run the step's memory plan (copy-on-write copies and swaps, as one ordered plan), write
the adapters given blocks into them (`lora_slots.py`), then one flat forward pass over
every scheduled chunk, then return the logits of the rows each chunk asks for
(`ScheduledChunk.num_logits`: the sampling rows, and prompt rows scored for prompt logprobs;
only those go through the LM head), with each chunk's rows of them (`StepLogits`). It keeps
each running sequence's block table and receives only changes to it
(`ScheduledChunk.table_update`), not every table every step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.model.decoder import DecoderModel
from pagedkv.weights.lora import LoRAAdapter
from pagedkv.worker.kv_cache import KVCache
from pagedkv.worker.lora_slots import load_adapters
from pagedkv.worker.step import ScheduledChunk, SchedulerOutput


@dataclass(frozen=True)
class StepLogits:
    """A step's float32 logits and, per chunk in order, its rows of them (computed once, where
    the batch is built). `logits` is None when no chunk asked for any."""

    logits: Tensor | None
    rows: tuple[range, ...]


class ModelRunner:
    """A model and its paged KV cache, advanced one scheduled step at a time."""

    def __init__(self, model: DecoderModel, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.cache.device
        # Each running sequence's block table, kept here and changed by the step's updates.
        self.block_tables: dict[tuple[str, int], list[int]] = {}
        self.forward_seconds = 0.0  # time inside plan + forward, for the outside-forward share
        self.model_seconds = 0.0  # time inside the model's forward alone
        self.last_num_seqs = 0  # sequences in the last forward pass (0: the step ran none)
        # The LoRA adapters requests named, read once, by id: what a load writes into blocks.
        self.lora_registry: dict[int, LoRAAdapter] = {}

    def execute(self, output: SchedulerOutput) -> StepLogits:
        """Run the plan and the forward pass; the logits of the rows the chunks ask for."""
        started = time.perf_counter()
        for seq_id in output.dropped:
            self.block_tables.pop(seq_id, None)
        if output.adapters:
            for lora_id in output.adapters.evicted:
                self.model.lora_adapters.pop(lora_id, None)
        self.kv_cache.execute(output.plan)
        if output.adapters.loaded:
            load_adapters(output.adapters.loaded, self.model, self.kv_cache, self.lora_registry)
        if not output.chunks:
            self.forward_seconds += time.perf_counter() - started
            self.last_num_seqs = 0
            return StepLogits(None, ())
        batch = ForwardBatch.build(
            [
                SequenceInput(
                    chunk.token_ids,
                    chunk.num_computed,
                    self._table(chunk),
                    chunk.num_logits,
                    chunk.lora_id,
                )
                for chunk in output.chunks
            ],
            self.kv_cache.block_size,
            device=self.device,
        )
        model_started = time.perf_counter()
        logits = self.model(batch, self.kv_cache)
        self.model_seconds += time.perf_counter() - model_started
        self.last_num_seqs = batch.num_seqs
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.forward_seconds += time.perf_counter() - started
        return StepLogits(logits if logits.shape[0] else None, batch.host_logits_rows)

    def _table(self, chunk: ScheduledChunk) -> list[int]:
        """The chunk's sequence's block table, with this step's update applied."""
        table = self.block_tables.setdefault(chunk.seq_id, [])
        if chunk.table_update is not None:
            first, block_ids = chunk.table_update
            table[first:] = block_ids
        return table
