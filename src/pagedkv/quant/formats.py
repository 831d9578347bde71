"""QuantizedTensor: the one layout every quantised weight is kept in, whatever its source.

A `[rows, cols]` weight is cut along its columns into groups of `group_size` values; each
group stores small integers `q` and two float32 numbers, so that

    w[r, g * group_size + i] = scales[r, g] * q[r, g * group_size + i] + mins[r, g]

Every GGUF block format we read fits this exactly (Q4_0's `d * (q - 8)` is `d * q + (-8 d)`,
Q4_K's `d * sc * q - dmin * m` is `scale * q + min` with both products exact in float32), so
re-packing a file's blocks loses nothing; `gguf_blocks.py` does it and its tests compare
against gguf's own dequantiser bit for bit. One layout means one matmul kernel to keep fast.

Scales and mins are float32, or float16 where every one of them is exactly a float16
(`narrowed`): GGUF's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 store theirs as float16, and keeping them
so streams a quarter fewer bytes per 4-bit group (a decode step is mostly that stream). The
kernels widen them exactly, so the arithmetic is the same either way.

Two widths:
- 4 bits: unsigned values 0..15, two per byte, groups of 32. Byte `j` of a group's 16 bytes
  holds value `j` in its low nibble and value `j + 16` in its high one (ggml's Q4_0 order),
  so a kernel widens 16 bytes to 32 values with one mask and one shift.
- 8 bits: signed values -128..127, one per byte, groups of 16 or 32 (Q6_K's groups are 16).

`values` keeps those bytes in "kernel order": within each whole block of 8 consecutive groups
of a row, 4-byte unit `u` of group `j` moves to unit `u * 8 + j`, so one 32-byte load holds a
unit of each of 8 groups and `kernels/qmatmul.c` sums 8 groups' integer products in 8 lanes.
Groups past a row's last whole block keep ggml's order. `from_ggml` builds one from ggml-order
bytes and `ggml_values` gives them back; both are permutations of bytes, so nothing is lost.

`in_panels()` gives the same weight in the panel layout (`quant/panels.py`), which the kernels
of AVX-512 VNNI machines read faster; `layout` says which one `values` holds. Scales and mins
are `[rows, groups]` either way, stored column-major in the panel layout (a transposed view:
the kernel finds 16 rows' scales of a group side by side).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from pagedkv.quant import panels

GROUP_SIZES = {4: (32,), 8: (16, 32)}
SCALE_DTYPES = (torch.float32, torch.float16)
LAYOUTS = ("kernel", "panels")


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantised `[rows, cols]` weight; see the module docstring for the layout."""

    values: Tensor  # kernel order: bits 4 uint8 [rows, cols // 2], bits 8 int8 [rows, cols]
    scales: Tensor  # float32 or float16 [rows, cols // group_size]
    mins: Tensor  # as scales (the same dtype)
    bits: int
    group_size: int
    layout: str = "kernel"  # or "panels": values uint8 [panels, groups * bytes per group]

    def __post_init__(self) -> None:
        # The kernels read the fields as packed arrays: row-major, but scales and mins
        # column-major in the panel layout (a transposed view, still [rows, groups] here).
        object.__setattr__(self, "values", self.values.contiguous())
        for name in ("scales", "mins"):
            tensor = getattr(self, name)
            packed = tensor.t().contiguous().t() if self.layout == "panels" else tensor.contiguous()
            object.__setattr__(self, name, packed)
        if self.bits not in GROUP_SIZES or self.group_size not in GROUP_SIZES[self.bits]:
            raise ValueError(f"no {self.bits}-bit layout with groups of {self.group_size}")
        rows, cols = self.shape
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of {LAYOUTS}")
        expected = (torch.uint8, cols // 2) if self.bits == 4 else (torch.int8, cols)
        if self.layout == "panels":
            if self.group_size != panels.GROUP:
                raise ValueError(f"the panel layout has groups of {panels.GROUP} only")
            expected = (torch.uint8, cols * self.bits // 8 * panels.PANEL_ROWS)
        if (self.values.dtype, self.values.shape[1]) != expected:
            raise ValueError(
                f"{self.bits}-bit values must be {expected[0]} with {expected[1]} columns, "
                f"got {self.values.dtype} with {self.values.shape[1]}"
            )
        groups = (rows, cols // self.group_size)
        for name in ("scales", "mins"):
            tensor = getattr(self, name)
            if tensor.dtype not in SCALE_DTYPES or tuple(tensor.shape) != groups:
                raise ValueError(
                    f"{name} must be float32 or float16 {groups}, got {tensor.dtype} "
                    f"{tuple(tensor.shape)}"
                )
        if self.scales.dtype != self.mins.dtype:
            raise ValueError(f"scales are {self.scales.dtype} but mins {self.mins.dtype}")

    @classmethod
    def from_ggml(
        cls, values: Tensor, scales: Tensor, mins: Tensor, bits: int, group_size: int
    ) -> QuantizedTensor:
        """A QuantizedTensor from `values` in ggml's byte order (what quantisers and files give)."""
        return cls(_to_kernel_order(values, bits, group_size), scales, mins, bits, group_size)

    def ggml_values(self) -> Tensor:
        """`values` in ggml's byte order."""
        return _to_kernel_order(self.kernel_values(), self.bits, self.group_size, inverse=True)

    def kernel_values(self) -> Tensor:
        """`values` in kernel order, whatever the layout."""
        if self.layout == "panels":
            return panels.from_panels(self.values, self.bits, *self.shape)
        return self.values

    def in_panels(self) -> QuantizedTensor:
        """The same weight in the panel layout (groups of 32 only)."""
        if self.layout == "panels":
            return self
        values = panels.to_panels(self.values, self.bits)
        return QuantizedTensor(
            values, self.scales, self.mins, self.bits, self.group_size, layout="panels"
        )

    @cached_property
    def shape(self) -> tuple[int, int]:
        """The logical `[rows, cols]` of the weight."""
        rows = self.scales.shape[0]
        return rows, self.scales.shape[1] * self.group_size

    @cached_property
    def kernel_ready(self) -> bool:
        """Whether the C kernels take this weight: in CPU memory, columns in chunks of 32."""
        return self.values.device.type == "cpu" and self.shape[1] % 32 == 0

    @cached_property
    def pointers(self) -> tuple[int, int, int, int, int]:
        """Addresses of values, scales and mins, whether those are float16, and whether any
        min is non-zero: what the C kernel is called with, computed once (a decode step makes
        ~120 calls)."""
        return (
            self.values.data_ptr(),
            self.scales.data_ptr(),
            self.mins.data_ptr(),
            int(self.half_scales),
            int(self.has_mins),
        )

    @property
    def half_scales(self) -> bool:
        """Whether scales and mins are kept as float16."""
        return self.scales.dtype == torch.float16

    @cached_property
    def has_mins(self) -> bool:
        """Whether any group has a non-zero min (symmetric formats have none)."""
        return bool(self.mins.any())

    @property
    def nbytes(self) -> int:
        """Bytes held in memory: values, scales and mins."""
        return sum(t.numel() * t.element_size() for t in (self.values, self.scales, self.mins))

    def integers(self) -> Tensor:
        """The values `q` as int16 `[rows, cols]`, unpacked."""
        values = self.ggml_values()
        if self.bits == 8:
            return values.to(torch.int16)
        rows, cols = self.shape
        grouped = values.view(rows, cols // 32, 16).to(torch.int16)
        return torch.cat((grouped & 0x0F, grouped >> 4), dim=-1).view(rows, cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight as a dense `[rows, cols]` tensor, computed in float32 then cast."""
        rows, cols = self.shape
        q = self.integers().view(rows, -1, self.group_size).to(torch.float32)
        dense = q * self.scales.float().unsqueeze(-1) + self.mins.float().unsqueeze(-1)
        return dense.view(rows, cols).to(dtype)

    def shard(
        self, first_row: int, num_rows: int, first_col: int, num_cols: int
    ) -> QuantizedTensor:
        """Rows `first_row ..` and columns `first_col ..` (whole groups), still quantised: a
        tensor-parallel rank's slice of a checkpoint weight, every value exactly as it was."""
        if first_col % self.group_size or num_cols % self.group_size:
            raise ValueError(
                f"columns {first_col}..{first_col + num_cols} do not cut groups of "
                f"{self.group_size} whole"
            )
        per_byte = 8 // self.bits  # values a byte holds; a group's bytes hold only its values
        rows = slice(first_row, first_row + num_rows)
        groups = slice(first_col // self.group_size, (first_col + num_cols) // self.group_size)
        # The byte order is permuted within each row: the rows kept are cut first.
        ggml = _to_kernel_order(self.kernel_values()[rows], self.bits, self.group_size, True)
        values = ggml[:, first_col // per_byte : (first_col + num_cols) // per_byte]
        return QuantizedTensor.from_ggml(
            values.contiguous(),
            self.scales[rows, groups],
            self.mins[rows, groups],
            self.bits,
            self.group_size,
        )

    def padded(self, num_rows: int) -> QuantizedTensor:
        """The weight with zero rows added up to `num_rows` (a padded vocabulary's shard); the
        byte order is within rows, so zero rows are zero in either order."""
        extra = num_rows - self.shape[0]
        if extra == 0:
            return self
        values = self.kernel_values()
        return QuantizedTensor(
            torch.cat((values, values.new_zeros(extra, values.shape[1]))),
            torch.cat((self.scales, self.scales.new_zeros(extra, self.scales.shape[1]))),
            torch.cat((self.mins, self.mins.new_zeros(extra, self.mins.shape[1]))),
            self.bits,
            self.group_size,
        )

    def rows(self, index: Tensor) -> QuantizedTensor:
        """The rows `index` (a 1-d int64 tensor), still quantised (in kernel order)."""
        if self.layout == "panels":
            values = panels.rows_from_panels(self.values, self.bits, self.shape[1], index)
        else:
            values = self.values[index]
        return QuantizedTensor(
            values, self.scales[index], self.mins[index], self.bits, self.group_size
        )


def padded_shard(
    tensor: Tensor | QuantizedTensor,
    first_row: int,
    num_rows: int,
    first_col: int,
    num_cols: int,
    padded_rows: int,
) -> Tensor | QuantizedTensor:
    """Rows `first_row ..` and columns `first_col ..` of a float or quantised weight, with zero
    rows added up to `padded_rows`: a tensor-parallel rank's slice (a quantised weight stays
    quantised, its columns cut in whole groups)."""
    if isinstance(tensor, QuantizedTensor):
        return tensor.shard(first_row, num_rows, first_col, num_cols).padded(padded_rows)
    rows = tensor[first_row : first_row + num_rows, first_col : first_col + num_cols]
    return torch.cat((rows, rows.new_zeros(padded_rows - num_rows, num_cols)))


def narrowed(scales: Tensor, mins: Tensor) -> tuple[Tensor, Tensor]:
    """`scales` and `mins` as float16 when every one of them is exactly a float16 (finite),
    else as they are."""
    both = torch.cat((scales.reshape(-1), mins.reshape(-1)))
    half = both.to(torch.float16)
    if torch.isfinite(half).all() and torch.equal(half.to(both.dtype), both):
        return scales.to(torch.float16), mins.to(torch.float16)
    return scales, mins


def _to_kernel_order(values: Tensor, bits: int, group_size: int, inverse: bool = False) -> Tensor:
    """ggml-order bytes `[rows, row_bytes]` in kernel order (or back, with `inverse`): in each
    whole block of 8 groups, 4-byte unit u of group j moves to unit u * 8 + j."""
    rows, row_bytes = values.shape
    units = bits * group_size // 32  # 4-byte units per group
    blocked = row_bytes // (32 * units) * (32 * units)  # bytes in whole blocks of 8 groups
    if blocked == 0 or rows == 0:  # no whole block, or none of a row (an empty shard)
        return values.contiguous()
    shape = (rows, -1, units, 8, 4) if inverse else (rows, -1, 8, units, 4)
    head = values[:, :blocked].reshape(shape).transpose(2, 3)
    return torch.cat((head.reshape(rows, blocked), values[:, blocked:]), dim=1).contiguous()
