"""Per-scheme summary of a simulation: utilisation, concurrency, waste, throughput, delay.

Utilisation is token state over the KV memory requests hold (reserved memory, for a slab):

- mean: summed over every step, state over held, the time-averaged fill of held memory;
- at completion: each request at its largest (its last step): the token state it then holds
  over the memory it then holds, summed over requests. This is the tutorial's measure: a slab
  reserved at max_model_len for a 500-token request is about a quarter full even then. It is
  no moment of the run (requests finish at different steps), so it is not a peak;
- peak over time: the highest state over held of any one step. It can exceed the figure at
  completion, for instance when the last request left running happens to fill its memory.

Waste is a time average as a fraction of the pool, split as in the vLLM paper: reservation
(held for tokens the request will write later), internal fragmentation (held, never to be
written), external fragmentation (free, yet too scattered for the waiting request). The
saving from sharing is averaged the same way: token slots that sequences sharing blocks would
otherwise each have held.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedkv.sim.schemes import SCHEME_LABELS
from pagedkv.sim.simulator import SimResult


@dataclass(frozen=True)
class SchemeSummary:
    """The numbers `pagedkv simulate` reports for one scheme."""

    scheme: str
    label: str
    steps: int
    mean_utilisation: float
    utilisation_at_completion: float
    peak_utilisation_over_time: float
    peak_running: int
    reservation_waste: float
    internal_fragmentation: float
    external_fragmentation: float
    sharing_saving: float
    finished: int
    finished_per_1000_steps: float
    mean_queue_delay: float
    preemptions: int
    stats: dict[str, object]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready values."""
        return asdict(self)


def summarize(result: SimResult) -> SchemeSummary:
    """Reduce a simulation's timeline to its summary."""
    timeline = result.timeline
    steps = result.steps
    held = sum(timeline.held(step) for step in range(steps))
    pool_steps = result.pool_tokens * steps
    return SchemeSummary(
        scheme=result.scheme,
        label=SCHEME_LABELS[result.scheme],
        steps=steps,
        mean_utilisation=sum(timeline.state) / held if held else 0.0,
        utilisation_at_completion=(
            result.final_tokens / result.final_held if result.final_held else 0.0
        ),
        peak_utilisation_over_time=max(
            (
                timeline.state[step] / timeline.held(step)
                for step in range(steps)
                if timeline.held(step)
            ),
            default=0.0,
        ),
        peak_running=max(timeline.running, default=0),
        reservation_waste=sum(timeline.reservation) / pool_steps,
        internal_fragmentation=sum(timeline.internal) / pool_steps,
        external_fragmentation=sum(timeline.external) / pool_steps,
        sharing_saving=sum(timeline.shared) / pool_steps,
        finished=result.finished,
        finished_per_1000_steps=1000 * result.finished / steps,
        mean_queue_delay=(
            sum(result.queue_delays) / len(result.queue_delays) if result.queue_delays else 0.0
        ),
        preemptions=result.preemptions,
        stats=result.stats,
    )
