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

import torch
from torch import Tensor

PANEL_ROWS = 16
GROUP = 32  # values per group: the one group size the panel layout has


def panel_count(rows: int) -> int:
    """Panels of a weight with `rows` output features."""
    return -(-rows // PANEL_ROWS)


def visit_order(groups: int) -> Tensor:
    """The group the kernel visits at each step (see the module docstring)."""
    blocks = groups // 8
    order = torch.arange(blocks * 8).view(blocks, 8).t().reshape(-1)
    return torch.cat((order, torch.arange(blocks * 8, groups)))


def to_panels(integers: Tensor, bits: int) -> Tensor:
    """Panel bytes `[panels, groups * bytes_per_group]` (uint8) of a weight's values `q`
    (`integers`: `[rows, cols]`, 0..15 for 4 bits, -128..127 for 8 bits)."""
    rows, cols = integers.shape
    groups, padded = cols // GROUP, panel_count(rows) * PANEL_ROWS
    q = torch.zeros(padded, cols, dtype=torch.int16)
    q[:rows] = integers
    if bits == 8:
        q[:rows] += 128
    # [panel, row c, group, unit q, e] -> [panel, group, unit q, row c, e]
    tiles = q.view(-1, PANEL_ROWS, groups, GROUP // 4, 4).permute(0, 2, 3, 1, 4)
    tiles = tiles[:, visit_order(groups)].reshape(-1, groups, PANEL_ROWS * GROUP).to(torch.uint8)
    if bits == 4:
        half = PANEL_ROWS * GROUP // 2
        tiles = tiles[..., :half] | (tiles[..., half:] << 4)
    return tiles.reshape(tiles.shape[0], -1).contiguous()


def from_panels(panels: Tensor, bits: int, rows: int, cols: int) -> Tensor:
    """The values `q` `[rows, cols]` (int16) of panel bytes: `to_panels` undone."""
    groups = cols // GROUP
    tiles = panels.view(panels.shape[0], groups, -1).to(torch.int16)
    tiles = torch.cat((tiles & 0x0F, tiles >> 4), dim=-1) if bits == 4 else tiles - 128
    unvisited = torch.empty_like(tiles)
    unvisited[:, visit_order(groups)] = tiles
    q = unvisited.view(-1, groups, GROUP // 4, PANEL_ROWS, 4).permute(0, 3, 1, 2, 4)
    return q.reshape(-1, cols)[:rows]
