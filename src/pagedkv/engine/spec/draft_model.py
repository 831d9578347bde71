"""The draft-model drafter: a smaller model of the registry, with the model's vocabulary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from pagedkv.engine.sampler import argmax
from pagedkv.engine.spec.config import SpeculativeConfig
from pagedkv.engine.spec.drafter import DraftRequest, SeqId
from pagedkv.engine.structured.mask import apply_grammar_masks
from pagedkv.engine.structured.state import GrammarState
from pagedkv.hf_cache import HubCacheError
from pagedkv.hub import UnknownModelName
from pagedkv.memory.adapters import AdapterChanges
from pagedkv.model.config import ModelConfig
from pagedkv.model.errors import ModelError
from pagedkv.tokenizer import Tokenizer
from pagedkv.weights.load import LoadedModel, NoRevisions, load
from pagedkv.worker.runner import ModelRunner
from pagedkv.worker.step import ScheduledChunk, SchedulerOutput

# A slot reserved for a draft the draft model proposes at the start of the step that verifies it.
UNDRAFTED = -1


class DraftModelDrafter:
    """A smaller model of the registry, with the same vocabulary, drafts greedily.

    Its K/V live in the same block ids as the model's (`worker.kv_budget.draft_kv_pool`), so
    every allocation, copy-on-write, swap, fork, prefix hit and rollback the memory manager
    plans covers them too; its `runner` keeps its own copy of the block tables from the same
    step data. A step runs it first (`fill`): every chunk the model computes, the draft model
    computes too (no logits, except where it drafts), and a sample with reserved draft slots
    gets its drafts from the draft model, one greedy token per pass, as many passes as the
    most drafts any sample verifies (its K/V written into those slots). The filled step, now
    with real drafts, is what the model verifies. Its drafts are its argmax: a one-hot
    proposal, so verification keeps exactly the model's own distribution. A sample with
    structured outputs drafts the argmax of what its grammar allows after the drafts before
    (a draft the grammar refuses could never be kept: its row, and every row after, would be
    computed for nothing).
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Reserved slots only: the drafts are made when their step starts (`fill`)."""
        return [[UNDRAFTED] * request.max_drafts for request in requests]

    def fill(
        self, output: SchedulerOutput, grammars: Mapping[SeqId, GrammarState]
    ) -> SchedulerOutput:
        """`output` with every chunk's reserved draft slots holding the draft model's drafts,
        after the draft model has computed the K/V of every chunk's tokens; a sample in
        `grammars` drafts only what its grammar allows. A LoRA adapter of the model is not
        one of the draft model's: it drafts with its own weights."""
        first = [
            replace(
                chunk,
                token_ids=chunk.token_ids[: len(chunk.token_ids) - chunk.num_draft_tokens],
                sample=bool(chunk.num_draft_tokens),
                num_logits=int(bool(chunk.num_draft_tokens)),
                num_draft_tokens=0,
                lora_id=0,
            )
            for chunk in output.chunks
        ]
        drafting = [chunk for chunk in output.chunks if chunk.num_draft_tokens]
        step = self.runner.execute(replace(output, chunks=first, adapters=AdapterChanges()))
        drafts: dict[SeqId, list[int]] = {chunk.seq_id: [] for chunk in drafting}
        rows = {chunk.seq_id: rows for chunk, rows in zip(first, step.rows, strict=True)}
        # Where each constrained sample's grammar stands before its next draft.
        states = dict(grammars)
        logits, passes = step.logits, [chunk for chunk in first if chunk.sample]
        for position in range(1, max((c.num_draft_tokens for c in drafting), default=0) + 1):
            if logits is not None:
                constrained = [chunk.seq_id for chunk in passes if chunk.seq_id in states]
                if constrained:  # the step's logits are inference tensors: mask a copy
                    logits = logits.clone()
                    apply_grammar_masks(
                        logits,
                        [rows[seq_id][-1] for seq_id in constrained],
                        [states[seq_id] for seq_id in constrained],
                    )
                for chunk in passes:
                    row = rows[chunk.seq_id][-1]
                    drafts[chunk.seq_id].append(int(argmax(logits[row])))
                    state = states.get(chunk.seq_id)
                    if state is not None and not state.finished:
                        states[chunk.seq_id] = state.advanced(drafts[chunk.seq_id][-1:])
            passes = [
                ScheduledChunk(
                    seq_id=chunk.seq_id,
                    token_ids=[drafts[chunk.seq_id][-1]],
                    num_computed=chunk.num_computed
                    + len(chunk.token_ids)
                    - chunk.num_draft_tokens
                    + position
                    - 1,
                    table_update=None,
                    sample=position < chunk.num_draft_tokens,
                    num_logits=int(position < chunk.num_draft_tokens),
                )
                for chunk in drafting
                if position <= chunk.num_draft_tokens
            ]
            # The last pass writes the last drafts' K/V, so a step that keeps every draft
            # leaves the draft model's K/V as complete as the model's.
            step = self.runner.execute(SchedulerOutput(chunks=passes))
            logits = step.logits
            rows = {chunk.seq_id: rows for chunk, rows in zip(passes, step.rows, strict=True)}
            passes = [chunk for chunk in passes if chunk.sample]
        return replace(
            output,
            chunks=[
                replace(
                    chunk,
                    token_ids=chunk.token_ids[: -chunk.num_draft_tokens] + drafts[chunk.seq_id],
                )
                if chunk.num_draft_tokens
                else chunk
                for chunk in output.chunks
            ],
        )


def load_draft_model(
    config: SpeculativeConfig,
    target: ModelConfig,
    tokenizer: Tokenizer,
    *,
    max_model_len: int,
    dtype: str,
    device: str,
    quantization: str,
    download_dir: str | None = None,
) -> LoadedModel:
    """The draft model `config` names, loaded as the model is; raise ValueError when its
    vocabulary is not the model's (its token ids would mean other tokens) or its context is
    shorter than max_model_len (it reads every position a sequence reaches)."""
    assert config.model is not None
    try:
        draft = load(
            config.model,
            dtype=dtype,
            device=device,
            quantization=quantization,
            download_dir=download_dir,
            revision=config.revision,
        )
    except (UnknownModelName, HubCacheError, NoRevisions) as error:  # else read as the model's
        raise ValueError(f"speculative_config model: {error}") from error
    except ModelError as error:  # a file of the draft's: named as the draft's
        raise ValueError(f"speculative_config model {config.model!r}: {error}") from error
    context = draft.config.max_position_embeddings
    if context < max_model_len:
        raise ValueError(
            f"speculative_config model {config.model!r} allows {context} positions "
            f"(max_position_embeddings), fewer than max_model_len {max_model_len}: lower "
            "max_model_len or pick a draft with a longer context"
        )
    if draft.tokenizer.vocab_size != tokenizer.vocab_size:
        raise ValueError(
            f"speculative_config model {config.model!r} has a vocabulary of "
            f"{draft.tokenizer.vocab_size} tokens and the model {tokenizer.vocab_size}: a draft "
            "model needs the model's tokenizer"
        )
    if draft.config.vocab_size != target.vocab_size:  # vLLM refuses these too
        raise ValueError(
            f"speculative_config model {config.model!r} has {draft.config.vocab_size} vocabulary "
            f"rows (vocab_size) and the model {target.vocab_size}, though both tokenizers have "
            f"{tokenizer.vocab_size} tokens: a draft's logits must cover the model's ids one "
            "for one (a checkpoint padded to another size)"
        )
    ids, draft_ids = tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    shared = ids.keys() & draft_ids.keys()  # added tokens one of them lacks do not count
    moved = sorted(token for token in shared if ids[token] != draft_ids[token])
    if moved or any(draft.tokenizer.encode(text) != tokenizer.encode(text) for text in _PROBES):
        what = f"gives {moved[0]!r} another id" if moved else "tokenizes text differently"
        raise ValueError(
            f"speculative_config model {config.model!r} {what} than the model: a draft model "
            "needs the model's tokenizer (its token ids would mean other tokens)"
        )
    return draft


# Texts both tokenizers must split alike: words, digits, punctuation, spacing, non-ASCII.
_PROBES = ("Hello, world! 12345 tokens:\n\tcafé naïve 東京 🙂", "def f(x):\n    return x ** 2")
