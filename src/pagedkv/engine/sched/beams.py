"""The scheduler's side of beam search: one step's decisions applied to the beams' blocks.

A beam search's beams are its request's samples. Once every live beam has its candidates
(`BeamState.ready`: after a preemption, recomputed beams may finish their rows at different
steps), the rule picks the extensions that live on (`BeamState.select`); a beam kept once
takes its token in place, one kept k times is first forked k - 1 times (the children's block
tables share all its blocks: `KVMemory.fork`), and one kept by none is freed, which returns
only the blocks no other beam holds. After the last step every live beam is done.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedkv.engine.beam_search import Candidate, Extension
from pagedkv.engine.request import Request, Sequence
from pagedkv.engine.sched.kv_memory import KVMemory

SeqId = tuple[str, int]


def advance_beams(
    request: Request,
    candidates: dict[SeqId, list[Candidate]],
    manager: KVMemory,
    free: Callable[[Sequence], None],
) -> None:
    """Record the step's `candidates` (per beam whose next row was computed) and, once every
    live beam has proposed, apply one step of the rule: fork, extend, free (with `free`)."""
    state = request.beam
    assert state is not None
    live = {seq.index: seq for seq in request.live_sequences}
    for index, seq in live.items():
        if seq.seq_id in candidates:
            state.propose(index, candidates[seq.seq_id])
    if not state.ready(list(live)):
        return
    children: dict[int, list[Extension]] = {}
    for extension in state.select():
        children.setdefault(extension.parent, []).append(extension)
    beams: list[tuple[Sequence, int, Extension]] = []
    for index, seq in live.items():
        extensions = children.get(index, [])
        if not extensions:
            free(seq)
            state.drop(index)
            continue
        for extension in extensions[1:]:  # before the parent's own: they copy its history
            child_id = (request.request_id, state.next_index)
            child = Sequence(
                seq_id=child_id,
                index=state.next_index,
                tokens=seq.tokens.copy(child_id),
                num_prompt_tokens=seq.num_prompt_tokens,
                num_computed=seq.num_computed,
            )
            state.next_index += 1
            request.sequences.append(child)  # first: an abort frees what the manager holds
            manager.fork(seq.seq_id, child_id, child.tokens)
            beams.append((child, index, extension))
        beams.append((seq, index, extensions[0]))
    for seq, parent, extension in beams:
        state.extend(seq.index, parent, extension)
        seq.token_ids.append(extension.candidate.token_id)
    request.sequences = [seq for seq, _, _ in beams]
    if state.done or not beams:
        state.finish([seq.index for seq in request.sequences])
        for seq in request.sequences:
            seq.finish_reason = "length"
