"""The panel layout: a quantised weight's bytes as `kernels/qmatmul.c` reads them fastest on
AVX-512 VNNI machines, and the exact permutations to it and back.

A `[rows, cols]` weight of 32-value groups is cut into panels of 16 rows (output features; the
last panel padded with zeros). A panel holds its groups one after another, and a group holds
the 16 rows' 32 values side by side: byte `64 q + 4 c + e` is value `4 q + e` of the panel's
row `c` (so one 64-byte vector holds 4 values of each of 16 rows, the unit `vpdpbusd` takes).
- 4 bits: those 512 values two to a byte, value `t` in the low nibble of byte `t` and value
  `256 + t` in its high one (256 bytes a group);
- 8 bits: one byte each, as `value + 128` (unsigned, as `vpdpbusd` multiplies; 512 bytes).
Groups are in the order the kernel's float part adds them: lane j of each whole block of 8
groups first (groups j, 8 + j, 16 + j, ...) for j = 0..7, then the groups past the last whole
block. Scales and mins keep their `[rows, groups]`, stored column-major (`formats.py`).

Every step is a permutation of values (or `+ 128`, undone exactly), so a weight goes to panels
and back unchanged; the kernel's float arithmetic follows kernel order lane for lane, so both
layouts give the same bits.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

PANEL_ROWS = 16
GROUP = 32  # values per group: the one group size the panel layout has
_PLUS_128 = 0x80808080 - (1 << 32)  # XOR adds 128 to each byte (mod 256), as int32 bits


def panel_count(rows: int) -> int:
    """Panels of a weight with `rows` output features."""
    return -(-rows // PANEL_ROWS)


def visit_order(groups: int) -> Tensor:
    """The group the kernel visits at each step (see the module docstring)."""
    blocks = groups // 8
    order = torch.arange(blocks * 8).view(blocks, 8).t().reshape(-1)
    return torch.cat((order, torch.arange(blocks * 8, groups)))


def to_panels(values: Tensor, bits: int) -> Tensor:
    """Panel bytes `[panels, groups * bytes_per_group]` (uint8) of kernel-order `values`
    (`formats.py`). A panel row is a 4-byte unit of a group (values 4q .. 4q + 3; with 4 bits,
    and 16 + 4q .. in the high nibbles), exactly the units kernel order keeps, so this moves
    whole units: no value is unpacked."""
    rows, row_bytes = values.shape
    units = bits  # 4-byte units per group of 32: 16 bytes (4 bits) or 32 (8 bits)
    groups = row_bytes // (4 * units)
    unit_values = values.contiguous().view(torch.int32)
    order = _visited_positions(groups, units)
    padded = torch.zeros(panel_count(rows) * PANEL_ROWS, groups * units, dtype=torch.int32)
    padded[:rows] = unit_values[:, order]
    if bits == 8:
        padded[:rows] ^= _PLUS_128
    # [panel, row c, visited group, unit q] -> [panel, visited group, unit q, row c]
    tiles = padded.view(-1, PANEL_ROWS, groups, units).permute(0, 2, 3, 1).contiguous()
    return tiles.view(torch.uint8).view(tiles.shape[0], -1)


@functools.cache
def _visited_positions(groups: int, units: int) -> Tensor:
    """Where each unit of a row in visit order goes in kernel order (`[groups * units]`),
    built once per shape."""
    return _unit_positions(groups, units)[visit_order(groups)].reshape(-1)


def _unit_positions(groups: int, units: int) -> Tensor:
    """`[groups, units]`: where unit u of group g sits among a kernel-order row's 4-byte
    units (in a whole block of 8 groups, unit u of group j at u * 8 + j; after, in order)."""
    g, u = torch.arange(groups)[:, None], torch.arange(units)[None, :]
    blocked = (g // 8) * 8 * units + u * 8 + g % 8
    return torch.where(g < groups // 8 * 8, blocked, g * units + u)


def from_panels(panels: Tensor, bits: int, rows: int, cols: int) -> Tensor:
    """The kernel-order values `[rows, row_bytes]` of panel bytes: `to_panels` undone."""
    units, groups = bits, cols // GROUP
    tiles = panels.contiguous().view(torch.int32).view(-1, groups, units, PANEL_ROWS)
    visited = tiles.permute(0, 3, 1, 2).reshape(-1, groups * units)[:rows]
    if bits == 8:
        visited = visited ^ _PLUS_128
    unit_values = torch.empty(visited.shape, dtype=torch.int32)
    unit_values[:, _visited_positions(groups, units)] = visited
    return unit_values.view(torch.uint8 if bits == 4 else torch.int8)


def rows_from_panels(panels: Tensor, bits: int, cols: int, index: Tensor) -> Tensor:
    """The kernel-order values `[len(index), row_bytes]` of rows `index` (a 1-d int64 tensor)
    alone: each row's units gathered out of its panel in one indexing, so that a lookup (an
    embedding table's tokens) reads its rows' bytes, not the whole weight's."""
    units, groups = bits, cols // GROUP
    flat = panels.contiguous().view(torch.int32).view(-1)
    first = (index // PANEL_ROWS) * (groups * units * PANEL_ROWS) + index % PANEL_ROWS
    picked = flat[first[:, None] + _unit_offsets(groups, units)]
    if bits == 8:
        picked ^= _PLUS_128
    return picked.view(torch.uint8 if bits == 4 else torch.int8)


@functools.cache
def _unit_offsets(groups: int, units: int) -> Tensor:
    """Where each unit of a kernel-order row sits in its panel, from the row's first unit
    (int32 units; `[groups * units]`)."""
    visited = torch.empty(groups * units, dtype=torch.int64)
    visited[_visited_positions(groups, units)] = torch.arange(groups * units)
    return visited * PANEL_ROWS
