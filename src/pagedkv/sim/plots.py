"""PNG figures of a simulation: utilisation vs batch size, concurrency over time, memory maps.

Drawn with matplotlib's Agg backend (no display needed) at fixed pixel sizes, so a figure
is the same picture on every machine.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from pagedkv.sim.memory_map import Cell, MemoryMap  # noqa: E402
from pagedkv.sim.schemes import SCHEME_LABELS  # noqa: E402
from pagedkv.sim.simulator import SimResult  # noqa: E402
from pagedkv.sim.sweep import SweepPoint  # noqa: E402

DPI = 100
UTILISATION_SIZE = (1000, 600)
CONCURRENCY_SIZE = (1000, 600)
MEMORY_MAP_SIZE = (1400, 800)

_SCHEME_COLOURS = {
    "slab-max": "#d62728",
    "slab-exact": "#ff7f0e",
    "paged": "#1f77b4",
    "paged-shared": "#2ca02c",
}
# Schemes that often coincide ((a) and (b) on the tutorial, (c) and (d) without sharing) are
# drawn solid and wide under dashed, so a hidden line still shows.
_SCHEME_STYLES = {
    "slab-max": {"linewidth": 4, "alpha": 0.5},
    "slab-exact": {"linewidth": 1.5, "linestyle": "--"},
    "paged": {"linewidth": 4, "alpha": 0.5},
    "paged-shared": {"linewidth": 1.5, "linestyle": "--"},
}
_FREE = (1.0, 1.0, 1.0)
_CACHED = (0.78, 0.78, 0.78)
# Saturated, grey-free colours for requests: greys would read as cached blocks, and pale
# ones as a slab's reserved-but-empty slots.
_OWNER_PALETTE = [
    colour
    for name in ("tab10", "Dark2")
    for colour in plt.get_cmap(name).colors
    if max(colour) - min(colour) > 0.1
]


def plot_utilisation_vs_batch_size(points: list[SweepPoint], path: Path) -> Path:
    """Utilisation at completion (solid) and time-averaged (dashed) per scheme, against batch
    size."""
    fig, ax = _figure(UTILISATION_SIZE)
    for scheme in dict.fromkeys(point.scheme for point in points):
        mine = [point for point in points if point.scheme == scheme]
        sizes = [point.batch_size for point in mine]
        colour = _SCHEME_COLOURS[scheme]
        at_completion = [100 * point.utilisation_at_completion for point in mine]
        ax.plot(
            sizes,
            at_completion,
            "o-",
            color=colour,
            label=f"{SCHEME_LABELS[scheme]}: at completion (each request at its largest)",
        )
        ax.plot(
            sizes,
            [100 * point.mean_utilisation for point in mine],
            "s--",
            color=colour,
            alpha=0.6,
            label=f"{SCHEME_LABELS[scheme]}: time-averaged",
        )
        for size, value in zip(sizes, at_completion, strict=True):
            ax.annotate(
                f"{value:.1f}%",
                (size, value),
                textcoords="offset points",
                xytext=(0, 8),
                ha="center",
                fontsize=9,
                color=colour,
            )
    ax.set_xscale("log")
    sizes = sorted({point.batch_size for point in points})
    ax.set_xticks(sizes, [str(size) for size in sizes])
    ax.minorticks_off()
    ax.set_ylim(0, 105)
    ax.set_xlabel("batch size (requests served together)")
    ax.set_ylabel("token state / held KV memory (%)")
    ax.set_title("KV memory utilisation vs batch size")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="center right")
    return _save(fig, path)


def plot_concurrency(results: list[SimResult], path: Path) -> Path:
    """Requests running at each step, one line per scheme."""
    fig, ax = _figure(CONCURRENCY_SIZE)
    for result in results:
        ax.plot(
            result.timeline.running,
            color=_SCHEME_COLOURS[result.scheme],
            label=f"{SCHEME_LABELS[result.scheme]} ({result.steps:,} steps)",
            **_SCHEME_STYLES[result.scheme],
        )
    ax.set_xlabel("step (one token per running sample)")
    ax.set_ylabel("requests running")
    ax.set_title("Concurrency over time, same requests and pool")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right")
    return _save(fig, path)


def plot_memory_maps(maps: list[MemoryMap], path: Path) -> Path:
    """The pools of several schemes at the same step, side by side, one square per block."""
    fig, axes = plt.subplots(1, len(maps), figsize=_inches(MEMORY_MAP_SIZE), dpi=DPI, squeeze=False)
    for ax, memory_map in zip(axes[0], maps, strict=True):
        _draw_map(ax, memory_map)
        held = len(memory_map.cells) - memory_map.count(Cell.FREE) - memory_map.count(Cell.CACHED)
        owners = {owner for owner in memory_map.owners if owner is not None}
        ax.set_title(
            f"{SCHEME_LABELS[memory_map.scheme]}\n{len(owners)} requests in "
            f"{held:,} of {len(memory_map.cells):,} blocks held",
            fontsize=11,
        )
    step = maps[0].step
    fig.suptitle(
        f"KV pool at step {step:,}: colour = owning request, one square = "
        f"{maps[0].block_size} token slots",
        fontsize=13,
    )
    fig.legend(
        handles=[
            Patch(facecolor="#4c72b0", label="holds KV (colour per request)"),
            Patch(facecolor=_lighten((0.3, 0.45, 0.69)), label="reserved, not yet written"),
            Patch(
                facecolor="#4c72b0",
                hatch="xx",
                edgecolor="black",
                label="shared by several sequences (x)",
            ),
            Patch(facecolor=_CACHED, edgecolor="grey", label="free, prefix still cached"),
            Patch(facecolor=_FREE, edgecolor="grey", label="free"),
        ],
        loc="lower center",
        ncol=5,
        fontsize=10,
        frameon=False,
    )
    fig.subplots_adjust(left=0.02, right=0.98, top=0.86, bottom=0.08, wspace=0.05)
    return _save(fig, path)


def _draw_map(ax, memory_map: MemoryMap) -> None:
    num_cells = len(memory_map.cells)
    columns = math.ceil(math.sqrt(num_cells))
    rows = math.ceil(num_cells / columns)
    image = np.ones((rows, columns, 3))
    shared = []
    for index, (cell, owner) in enumerate(zip(memory_map.cells, memory_map.owners, strict=True)):
        row, column = divmod(index, columns)
        if cell is Cell.FREE:
            colour = _FREE
        elif cell is Cell.CACHED:
            colour = _CACHED
        else:
            colour = _owner_colour(owner)
            if cell is Cell.RESERVED:
                colour = _lighten(colour)
            elif cell is Cell.SHARED:
                shared.append((column, row))
        image[row, column] = colour
    ax.imshow(image, interpolation="nearest", aspect="equal")
    if shared:
        xs, ys = zip(*shared, strict=True)
        ax.scatter(xs, ys, marker="x", s=max(4, 2400 / columns), c="black", linewidths=0.8)
    if columns <= 80:
        ax.set_xticks(np.arange(-0.5, columns, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=0.4)
    ax.tick_params(which="both", length=0, labelbottom=False, labelleft=False)
    ax.set_xlabel(f"{num_cells:,} blocks, row by row in address order", fontsize=9)
    ax.xaxis.set_label_position("bottom")


def _owner_colour(owner: object) -> tuple[float, float, float]:
    """A stable, distinct-enough colour per request id."""
    return _OWNER_PALETTE[(hash(owner) * 7) % len(_OWNER_PALETTE)][:3]


def _lighten(colour: tuple[float, float, float], amount: float = 0.7) -> tuple[float, ...]:
    return tuple(channel + (1 - channel) * amount for channel in colour)


def _inches(size: tuple[int, int]) -> tuple[float, float]:
    return size[0] / DPI, size[1] / DPI


def _figure(size: tuple[int, int]):
    fig, ax = plt.subplots(figsize=_inches(size), dpi=DPI)
    return fig, ax


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
