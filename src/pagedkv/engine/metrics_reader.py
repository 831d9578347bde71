"""`LLM.get_metrics()`'s values: vLLM's metric types (`vllm.v1.metrics.reader`), read from one
Prometheus registry, so vLLM code that reads them (its speculative-decoding example counting
drafts and accepted tokens) runs unchanged.

A counter is reported under its family's name (`vllm:prompt_tokens`, not `..._total`) with
its labels; the accepted-tokens-per-position counters, one per `position` label, become one
`Vector` indexed by position, as vLLM's reader gives them; a histogram carries its cumulative
bucket counts keyed by their upper bound (`"+Inf"` last), its count and sum.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client import Metric as Family

PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Metric:
    """One metric of a name and a set of labels (a name may come with several)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A count that only grows."""

    value: int


@dataclass
class Vector(Metric):
    """Counters indexed by position (accepted draft tokens per position after the last token)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value at the moment of reading."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: `buckets` maps each upper bound to the count at or below it."""

    count: int
    sum: float
    buckets: dict[str, int]


def read_metrics(registry: CollectorRegistry) -> list[Metric]:
    """Every gauge, counter and histogram the registry collects now, in its order."""
    metrics: list[Metric] = []
    for family in registry.collect():
        if family.type == "gauge":
            metrics += [Gauge(family.name, s.labels, s.value) for s in family.samples]
        elif family.type == "counter":
            totals = [s for s in family.samples if s.name == f"{family.name}_total"]
            if family.name.endswith(f":{PER_POSITION}"):
                metrics += _vectors(family.name, totals)
            else:
                metrics += [Counter(family.name, s.labels, int(s.value)) for s in totals]
        elif family.type == "histogram":
            metrics += _histograms(family)
    return metrics


def _without(labels: dict[str, str], name: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((key, value) for key, value in labels.items() if key != name))


def _vectors(name: str, samples: list) -> list[Metric]:
    """One Vector per label set, its values by `position` (positions not given count 0)."""
    by_labels: dict[tuple[tuple[str, str], ...], dict[int, int]] = {}
    for sample in samples:
        counts = by_labels.setdefault(_without(sample.labels, "position"), {})
        counts[int(sample.labels["position"])] = int(sample.value)
    length = 1 + max((p for counts in by_labels.values() for p in counts), default=-1)
    return [
        Vector(name, dict(labels), [counts.get(p, 0) for p in range(length)])
        for labels, counts in by_labels.items()
    ]


def _histograms(family: Family) -> list[Metric]:
    """One Histogram per label set, from its `_bucket`, `_count` and `_sum` samples."""
    parts: dict[tuple[tuple[str, str], ...], dict] = {}
    for sample in family.samples:
        suffix = sample.name[len(family.name) :]
        part = parts.setdefault(_without(sample.labels, "le"), {"buckets": {}})
        if suffix == "_bucket":
            part["buckets"][sample.labels["le"]] = int(sample.value)
        elif suffix in ("_count", "_sum"):
            part[suffix[1:]] = sample.value
    return [
        Histogram(family.name, dict(labels), int(part["count"]), part["sum"], part["buckets"])
        for labels, part in parts.items()
    ]
