"""The panel layout: its bytes where its docstring puts them, the same weight back, and the same
products, bit for bit, as kernel order.

The byte oracle walks the layout's definition value by value (row, group, value -> panel, byte,
nibble), independently of the unit moves `quant/panels.py` computes it with. The products
are compared with the kernel-order kernel's (tests/quant/test_qmatmul.py checks that one).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagedkv.kernels import native
from pagedkv.quant import panels
from pagedkv.quant.formats import QuantizedTensor
from pagedkv.quant.matmul import dequantize, kernel_layout, quantized_linear


def random_weight(
    rows: int, cols: int, bits: int, half: bool, mins: bool, seed: int
) -> QuantizedTensor:
    """A QuantizedTensor of random values, scales and (or no) mins, groups of 32."""
    generator = torch.Generator().manual_seed(seed)
    groups = cols // 32
    if bits == 4:
        q = torch.randint(0, 16, (rows, groups, 2, 16), generator=generator).to(torch.uint8)
        values = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(rows, cols // 2)
    else:
        values = torch.randint(-128, 128, (rows, cols), generator=generator).to(torch.int8)
    scales = torch.rand(rows, groups, generator=generator) * 0.05
    offsets = torch.rand(rows, groups, generator=generator) - 0.5
    minimums = offsets if mins else torch.zeros(rows, groups)
    if half:
        scales, minimums = scales.half(), minimums.half()
    return QuantizedTensor.from_ggml(values, scales, minimums, bits, 32)


def layout_by_definition(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Panel bytes of values `q` [rows, cols], one value at a time, as the module docstring
    defines them."""
    rows, cols = q.shape
    groups, blocks = cols // 32, cols // 32 // 8
    visits = [(b * 8 + j) for j in range(8) for b in range(blocks)]
    visits += list(range(blocks * 8, groups))
    per_group = 256 if bits == 4 else 512
    out = torch.zeros(-(-rows // 16), groups * per_group, dtype=torch.int64)
    for row in range(rows):
        panel, c = divmod(row, 16)
        for visit, group in enumerate(visits):
            for i in range(32):
                t = 64 * (i // 4) + 4 * c + i % 4
                value = int(q[row, group * 32 + i])
                if bits == 8:
                    out[panel, visit * 512 + t] = value + 128
                else:
                    byte, nibble = t % 256, t // 256
                    out[panel, visit * 256 + byte] |= value << (4 * nibble)
    return out.to(torch.uint8)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("rows", "cols"), [(5, 32), (16, 288), (20, 576)])
def test_bytes_follow_the_definition(bits: int, rows: int, cols: int) -> None:
    weight = random_weight(rows, cols, bits, half=True, mins=True, seed=rows + cols)
    expected = layout_by_definition(weight.integers(), bits)  # padded rows: zero bytes
    assert torch.equal(weight.in_panels().values, expected)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("half", [True, False])
@pytest.mark.parametrize(("rows", "cols"), [(1, 32), (16, 256), (17, 64), (40, 288), (33, 1536)])
def test_the_same_weight_comes_back(bits: int, half: bool, rows: int, cols: int) -> None:
    weight = random_weight(rows, cols, bits, half, mins=bits == 4, seed=3)
    paneled = weight.in_panels()
    assert paneled.layout == "panels" and paneled.shape == weight.shape
    assert torch.equal(paneled.integers(), weight.integers())
    assert torch.equal(paneled.ggml_values(), weight.ggml_values())
    assert torch.equal(paneled.scales, weight.scales) and torch.equal(paneled.mins, weight.mins)
    assert torch.equal(dequantize(paneled), dequantize(weight))
    assert paneled.nbytes - weight.nbytes == (-rows % 16) * cols * bits // 8
    generator = torch.Generator().manual_seed(rows)
    index = torch.cat((torch.randperm(rows, generator=generator), torch.tensor([rows - 1, 0])))
    picked, expected = paneled.rows(index), weight.rows(index)
    assert picked.layout == "kernel"
    for part in ("values", "scales", "mins"):
        assert torch.equal(getattr(picked, part), getattr(expected, part)), part


def test_a_bad_panel_layout_is_refused() -> None:
    weight = random_weight(16, 64, 4, half=True, mins=True, seed=4)
    with pytest.raises(ValueError, match="layout 'tiles'"):
        QuantizedTensor(weight.values, weight.scales, weight.mins, 4, 32, layout="tiles")
    with pytest.raises(ValueError, match="uint8 with 512 columns"):
        QuantizedTensor(weight.values, weight.scales, weight.mins, 4, 32, layout="panels")


needs_panels = pytest.mark.skipif(
    native.kernels() is None or not native.kernels().panels,
    reason="the panel kernel is built for AVX-512 VNNI only",
)


@needs_panels
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("half", [True, False])
@pytest.mark.parametrize("mins", [True, False])
@pytest.mark.parametrize(("rows", "cols"), [(1, 32), (16, 256), (17, 288), (40, 576)])
def test_products_equal_kernel_orders_bit_for_bit(
    bits: int, half: bool, mins: bool, rows: int, cols: int
) -> None:
    weight = random_weight(rows, cols, bits, half, mins, seed=rows * cols + bits)
    paneled = weight.in_panels()
    generator = torch.Generator().manual_seed(5)
    bias = torch.randn(rows, generator=generator)
    for m in (1, 3, 8, 9, 70):
        x = torch.randn(m, cols, generator=generator) * 3
        for b in (None, bias):
            assert torch.equal(quantized_linear(x, paneled, b), quantized_linear(x, weight, b))


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The kernels' OpenMP threads (PyTorch's pool) at 2 for the test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@needs_panels
@pytest.mark.parametrize(
    ("bits", "rows", "cols", "half", "mins"),
    [(4, 4144, 1056, True, True), (8, 2096, 1056, False, False)],
)
def test_big_weights_read_several_panels_at_once_give_the_same_bits(
    bits: int, rows: int, cols: int, half: bool, mins: bool, two_threads: None
) -> None:
    """Weights of 2 MiB or more with 1024 or more inputs, times at most 16 rows, are read four
    panels at a time up to 4 rows, three past that (qmatmul.c, STREAMS): these are just above
    that size, with panels left over past the last four or three (259 and 131 panels), a tail
    group (33 groups of 32), and row counts that leave a short pass of 8. Two threads, as a
    weight needs 16 panels a thread for the several-panel reads."""
    weight = random_weight(rows, cols, bits, half, mins, seed=rows + bits)
    paneled = weight.in_panels()
    assert paneled.values.numel() >= 2 << 20
    generator = torch.Generator().manual_seed(11)
    bias = torch.randn(rows, generator=generator)
    for m in (1, 2, 3, 4, 5, 9, 16, 17):
        x = torch.randn(m, cols, generator=generator) * 3
        for b in (None, bias):
            assert torch.equal(quantized_linear(x, paneled, b), quantized_linear(x, weight, b))


@needs_panels
def test_rows_come_out_the_same_whatever_shares_the_call() -> None:
    weight = random_weight(48, 576, 4, half=True, mins=True, seed=6).in_panels()
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(7))
    together = quantized_linear(x, weight, None)
    for start, stop in ((0, 1), (5, 11), (30, 37)):
        assert torch.equal(quantized_linear(x[start:stop], weight, None), together[start:stop])


def test_kernel_layout_chooses_panels_where_the_kernels_read_them() -> None:
    kernels = native.kernels()
    groups_of_32 = random_weight(16, 64, 4, half=True, mins=True, seed=8)
    expected = "panels" if kernels is not None and kernels.panels else "kernel"
    assert kernel_layout(groups_of_32).layout == expected
    generator = torch.Generator().manual_seed(9)
    values = torch.randint(-128, 128, (16, 64), generator=generator).to(torch.int8)
    scales = torch.rand(16, 4, generator=generator).half()
    groups_of_16 = QuantizedTensor.from_ggml(values, scales, torch.zeros_like(scales), 8, 16)
    assert kernel_layout(groups_of_16).layout == "kernel"
    partial_panel = random_weight(17, 64, 4, half=True, mins=True, seed=10)
    assert kernel_layout(partial_panel).layout == "kernel"  # no padded bytes in memory


def test_visit_order_takes_each_group_once_lanes_first() -> None:
    assert panels.visit_order(18).tolist() == [
        0,
        8,
        1,
        9,
        2,
        10,
        3,
        11,
        4,
        12,
        5,
        13,
        6,
        14,
        7,
        15,
        16,
        17,
    ]
    assert panels.visit_order(3).tolist() == [0, 1, 2]
