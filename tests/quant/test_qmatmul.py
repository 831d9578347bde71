"""`quantized_linear` and the C kernels against float64 arithmetic on the exact weights.

Every weight here is built from known integers, scales and mins, so the float64 product of
the *exact* weight `scale * q + min` is the oracle: nothing under test (not even
`QuantizedTensor.dequantize` or its unpacking) computes the reference.

One path, for every row count: the int8 dot-product kernel quantises the activations per group
to int8, so its error is that quantisation's: each activation is rounded to the nearest step of
  `amax_g(x) / 127`, i.e. off by at most `amax_g / 254`, and that error multiplies the whole
  weight `scale * q + min` (the min's term takes the quantised activations' sum, as llama.cpp's
  Q8_1 does), so
  per output  |err| <= sum_g amax_g(x) / 254 * sum_{i in g} |w_i|  + float32 slack.
  A second, tighter oracle simulates that activation quantisation in torch (the dequantised
  weight times the quantised activations) and asks for agreement to float32 slack: a min's
  term taken with the exact sum of x instead, ~2.7x the error on 4-bit weights, fails it.
The torch fallback (no C compiler) dequantises and multiplies in float32: rounding only.
Float32 slack is the worst-case bound for a sum of n float32 terms in any order,
`n * eps * sum |terms|` (Higham's gamma_n), with n the longest chain of additions the path makes.
"""

from __future__ import annotations

import functools
import shutil

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.kernels import native
from pagedkv.quant import matmul
from pagedkv.quant.formats import QuantizedTensor
from pagedkv.quant.matmul import quantized_linear, uses_kernels

EPS32 = torch.finfo(torch.float32).eps
# (bits, group_size, with mins, float16 scales): every layout QuantizedTensor has, with and
# without mins, its scales and mins kept as float32 or float16.
LAYOUTS = [
    (bits, group, with_mins, half)
    for bits, group in ((4, 32), (8, 32), (8, 16))
    for with_mins in (False, True)
    for half in (False, True)
]
# Batch sizes: 0, every remainder of the kernel's 4-row tiles (8-row on AVX-512), and past its
# tile of rows that share the cache (clamp(16384 / cols, 4, 64) rows).
BATCHES = [0, 1, 2, 3, 4, 5, 7, 8, 9, 17, 33, 70, 200]


def layout_id(layout: tuple[int, int, bool, bool]) -> str:
    bits, group, with_mins, half = layout
    return f"{bits}bit-g{group}-{'mins' if with_mins else 'sym'}-{'f16' if half else 'f32'}"


@pytest.fixture(scope="module")
def kernels() -> native.Kernels:
    """The compiled kernels; without a C compiler the kernel paths cannot be tested here."""
    built = native.kernels()
    if built is None:
        pytest.skip(f"quantised matmul kernel unavailable: {native.unavailable_reason()}")
    return built


def make_weight(
    rows: int, cols: int, bits: int, group: int, with_mins: bool, seed: int, half: bool = False
) -> tuple[QuantizedTensor, torch.Tensor]:
    """A random QuantizedTensor and its exact float64 weight, from integers packed here.

    Values cover each width's full range (8-bit includes -128); scales are signed with
    magnitudes spread over two decades per row, as real files have them. With `half`, scales
    and mins are float16 values, kept as float16.
    """
    gen = torch.Generator().manual_seed(seed)
    groups = cols // group
    if bits == 4:
        q = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.int16)
        chunks = q.view(rows, cols // 32, 32).to(torch.uint8)
        # ggml's order: byte j of a 32-value chunk = value j (low nibble) | value j+16 (high)
        values = (chunks[..., :16] | (chunks[..., 16:] << 4)).reshape(rows, cols // 2)
    else:
        q = torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int16)
        values = q.to(torch.int8)
    magnitude = 10 ** (2 * torch.rand(rows, 1, generator=gen) - 3)  # 1e-3 .. 1e-1 per row
    scales = torch.randn(rows, groups, generator=gen) * magnitude
    if with_mins:
        mins = torch.randn(rows, groups, generator=gen) * magnitude * 8
    else:
        mins = torch.zeros(rows, groups)
    if half:
        scales, mins = scales.half(), mins.half()
    weight = QuantizedTensor.from_ggml(values.contiguous(), scales, mins, bits, group)
    exact = (
        q.to(torch.float64).view(rows, groups, group) * scales.double().unsqueeze(-1)
        + mins.double().unsqueeze(-1)
    ).view(rows, cols)
    return weight, exact


def make_input(batch: int, cols: int, seed: int) -> torch.Tensor:
    """Gaussian activations with a few columns scaled by 8, so group maxima differ a lot."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, cols, generator=gen)
    x[:, torch.randint(0, cols, (max(1, cols // 64),), generator=gen)] *= 8
    return x


def make_bias(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, generator=torch.Generator().manual_seed(seed + 2))


def integer_part(weight: QuantizedTensor, exact: torch.Tensor) -> torch.Tensor:
    """|scale * q| per weight in float64: the part of W the activation error multiplies."""
    mins = weight.mins.double().repeat_interleave(weight.group_size, dim=1)
    return (exact - mins).abs()


def rounding_bound(weight: QuantizedTensor, exact: torch.Tensor) -> torch.Tensor:
    """`scale * q + min` in float32 rounds twice (or once, fused): within eps of each term."""
    mins = weight.mins.double().abs().repeat_interleave(weight.group_size, dim=1)
    return 2 * EPS32 * (integer_part(weight, exact) + mins)


def group_amax(x: torch.Tensor, group: int) -> torch.Tensor:
    """`amax_g(x)` `[batch, cols // group]` in float64."""
    batch, cols = x.shape
    return x.double().abs().view(batch, cols // group, group).amax(dim=-1)


def magnitude_sum(
    x: torch.Tensor, weight: QuantizedTensor, exact: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """sum_i (|scale q_i| + |min|) * (|x_i| + amax_g / 127) + |b|: what every rounding scales.

    The `amax / 127` term covers the activations' quantised values, which may exceed |x| by up
    to half a step.
    """
    group = weight.group_size
    mins = weight.mins.double().abs().repeat_interleave(group, dim=1)
    weights = integer_part(weight, exact) + mins
    pad = group_amax(x, group).repeat_interleave(group, dim=1) / 127
    total = (x.double().abs() + pad) @ weights.T
    if bias is not None:
        total = total + bias.double().abs()
    return total


def dot_path_bound(
    x: torch.Tensor, weight: QuantizedTensor, exact: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The int8 path's error bound per output `[batch, rows]` (see the module docstring).

    Quantisation: amax_g / 254 per activation, times sum |w| over the group; the factor
    1 + 1e-4 covers the float32 rounding of `127 / amax`, of `x * (127 / amax)` before it is
    rounded to an integer, and of the step `amax / 127` (each a few eps of 127 steps).
    Float32 slack: the kernel sums cols / 32 chunk products per lane, 8 lanes, the per-group
    quantised sums of x (group terms) and cols / group min products; 2 (cols + 16) eps covers
    all.
    """
    rows, cols = weight.shape
    group = weight.group_size
    groups = cols // group
    step = group_amax(x, group) / 254  # [batch, groups]
    per_group = exact.abs().view(rows, groups, group).sum(-1)  # [rows, groups]
    quantisation = step @ per_group.T * (1 + 1e-4)
    slack = 2 * (cols + 16) * EPS32 * magnitude_sum(x, weight, exact, bias)
    return quantisation + slack


def float_path_bound(
    x: torch.Tensor, weight: QuantizedTensor, exact: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Dequantise + float32 BLAS: each weight rounded once or twice to float32 (2 eps), then a
    float32 sum of cols + 1 terms in any order (gamma_(cols+1)); 2 (cols + 4) eps covers both."""
    cols = weight.shape[1]
    return 2 * (cols + 4) * EPS32 * magnitude_sum(x, weight, exact, bias)


def reference(x: torch.Tensor, exact: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ exact.T
    return out if bias is None else out + bias.double()


def simulated_dot_path(
    x: torch.Tensor, weight: QuantizedTensor, exact: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """What the int8 path computes, in float64 after float32 activation quantisation done the
    kernel's way (float32 `127 / amax`, float32 product, round half to even, float32 step)."""
    batch, cols = x.shape
    group = weight.group_size
    groups = x.view(batch, cols // group, group)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(groups * inverse)
    step = amax / torch.tensor(127.0)
    dequantised = (xq.double() * step.double()).view(batch, cols)
    out = dequantised @ exact.T
    return out if bias is None else out + bias.double()


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str):
    error = (actual.double() - expected).abs()
    excess = error - bound
    worst = int(excess.argmax()) if excess.numel() else 0
    assert bool((excess <= 0).all()), (
        f"{what}: error {error.flatten()[worst]:.3g} over bound {bound.flatten()[worst]:.3g} "
        f"at flat index {worst} ({int((excess > 0).sum())} of {excess.numel()} outputs over)"
    )


def check_product(batch: int, rows: int, cols: int, layout, with_bias: bool, seed: int):
    bits, group, with_mins, half = layout
    weight, exact = make_weight(rows, cols, bits, group, with_mins, seed, half)
    x = make_input(batch, cols, seed)
    bias = make_bias(rows, seed) if with_bias else None
    out = quantized_linear(x, weight, bias)
    assert out.shape == (batch, rows) and out.dtype == torch.float32
    expected = reference(x, exact, bias)
    what = f"{layout_id(layout)} bias={with_bias} {batch}x{cols} @ {rows}x{cols}"
    assert_within(out, expected, dot_path_bound(x, weight, exact, bias), what)
    # Tighter: the kernel's own activation quantisation, simulated, to float32 slack.
    simulated = simulated_dot_path(x, weight, exact, bias)
    slack = 2 * (cols + 16) * EPS32 * magnitude_sum(x, weight, exact, bias)
    assert_within(out, simulated, slack, what + " (simulated int8 path)")


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_every_batch_size_and_layout(kernels, layout, with_bias):
    """Every layout, with and without bias, at every batch size of BATCHES: every tile
    remainder (batches 1-9: row tiles of 1-8). Rows 7 x cols 96: a partial group of 8 columns,
    tail groups only; rows 17 x cols 320: two whole groups of 8 columns (the paired columns and
    the 8-column tail path of AVX-512 builds) and one more, a whole block of 8 groups and tails."""
    for batch in BATCHES:
        for rows, cols in ((7, 96), (17, 320)):
            check_product(batch, rows, cols, layout=layout, with_bias=with_bias, seed=batch)


@settings(deadline=None, max_examples=40, derandomize=True)
@given(
    layout=st.sampled_from(LAYOUTS),
    with_bias=st.booleans(),
    rows=st.integers(1, 300),
    chunks=st.integers(1, 32),
    batch=st.sampled_from(BATCHES),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(kernels, layout, with_bias, rows, chunks, batch, seed):
    """Random shapes (rows 1..300, cols 32..1024) against the float64 product's bounds."""
    check_product(batch, rows, 32 * chunks, layout, with_bias, seed)


def test_batch_dimensions_are_kept(kernels):
    """`x` `[2, 3, cols]` and `[7, 10, cols]` come back as `[..., rows]`, each row the product
    of its own activations alone, to the bit (checked row by row)."""
    weight, _ = make_weight(10, 64, 8, 32, True, seed=5)
    for shape in ((2, 3), (7, 10)):
        x = make_input(shape[0] * shape[1], 64, seed=6)
        out = quantized_linear(x.view(*shape, 64), weight, None)
        assert out.shape == (*shape, 10)
        flat = out.view(-1, 10)
        for row in range(x.shape[0]):
            assert torch.equal(flat[row], quantized_linear(x[row : row + 1], weight, None)[0])


def test_low_precision_inputs_keep_their_dtype(kernels):
    """bfloat16 activations come back bfloat16 at any batch size, within bfloat16 rounding of the
    float32 result for the same (bfloat16-representable) activations: 2^-8 relative, doubled."""
    weight, _ = make_weight(12, 64, 4, 32, True, seed=7)
    for batch in (2, 20):
        x = make_input(batch, 64, seed=8).to(torch.bfloat16)
        out = quantized_linear(x, weight, None)
        assert out.dtype == torch.bfloat16
        full = quantized_linear(x.float(), weight, None)
        torch.testing.assert_close(out.float(), full, rtol=2**-7, atol=1e-6)


def test_torch_fallback_without_kernels(monkeypatch):
    """With no kernels (no C compiler), the product is `F.linear` of the torch dequantisation,
    and that is the float64 product to float32 rounding, on every layout and batch size."""
    monkeypatch.setattr(native, "kernels", lambda: None)
    for index, layout in enumerate(LAYOUTS):
        for batch in (1, 9):
            weight, exact = make_weight(9, 64, *layout[:3], seed=100 + index, half=layout[3])
            x = make_input(batch, 64, seed=index)
            bias = make_bias(9, seed=index)
            out = quantized_linear(x, weight, bias)
            assert torch.equal(out, F.linear(x, weight.dequantize(), bias))
            bound = float_path_bound(x, weight, exact, bias)
            assert_within(out, reference(x, exact, bias), bound, f"fallback {layout}")
        assert torch.equal(matmul.dequantize(weight), weight.dequantize())


def test_columns_the_kernel_does_not_take():
    """8-bit groups of 16 allow 48 columns, which the kernels (chunks of 32) do not take:
    `uses_kernels` says so and both the product and `dequantize` are still right."""
    weight, exact = make_weight(5, 48, 8, 16, True, seed=11)
    for batch in (1, 4, 12):
        x = make_input(batch, 48, seed=12)
        assert not uses_kernels(x, weight)
        out = quantized_linear(x, weight, None)
        assert_within(
            out, reference(x, exact, None), float_path_bound(x, weight, exact, None), "48 cols"
        )
    assert uses_kernels(make_input(1, 64, 0), make_weight(5, 64, 8, 16, True, 0)[0])
    assert_within(matmul.dequantize(weight), exact, rounding_bound(weight, exact), "48 cols")


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_kernel_dequantize_equals_torch_dequantize(kernels, layout):
    """The C dequantiser (`matmul.dequantize`) gives exactly `QuantizedTensor.dequantize()`:
    both compute `scale * q + min` in float32, so any difference is a rounding the two paths
    do differently (a weight that depends on whether a C compiler was found)."""
    weight, exact = make_weight(37, 160, *layout[:3], seed=21, half=layout[3])
    dense = matmul.dequantize(weight)
    torch_dense = weight.dequantize()
    differ = int((dense != torch_dense).sum())
    assert differ == 0, (
        f"{differ} of {dense.numel()} weights differ, by up to "
        f"{float((dense - torch_dense).abs().max()):.3g}"
    )
    # and both are the exact weight, rounded
    assert_within(torch_dense, exact, rounding_bound(weight, exact), "torch dequantize")


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("cols", [96, 288, 544])  # no whole block of 8 groups; a tail; none
def test_kernel_picks_rows_as_torch_dequantizes_them(kernels, layout, cols):
    """`matmul.dequantize_rows` gives exactly the rows of `QuantizedTensor.dequantize()`, in
    kernel order and (groups of 32) in the panel layout, for any rows, repeated or not; a row
    past the weight is an IndexError, not a read past its bytes."""
    if cols % layout[1]:
        pytest.skip("groups do not divide the columns")
    weight, _ = make_weight(48, cols, *layout[:3], seed=cols, half=layout[3])
    index = torch.tensor([0, 47, 5, 5, 16, 31, 32, 17])
    dense = weight.dequantize()
    forms = [weight] + ([weight.in_panels()] if layout[1] == 32 else [])
    for form in forms:
        assert torch.equal(matmul.dequantize_rows(form, index), dense[index]), form.layout
        assert matmul.dequantize_rows(form, index[:0]).shape == (0, cols)
        for bad in (48, -1):
            with pytest.raises(IndexError, match="48 rows"):
                matmul.dequantize_rows(form, torch.tensor([3, bad]))


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout[3]], ids=layout_id)
def test_float16_scales_give_the_float32_products_bit_for_bit(kernels, layout):
    """Scales and mins kept as float16 are widened exactly: the product and the dequantised
    weight equal those of the same values kept as float32, at every batch size."""
    half, exact = make_weight(11, 288, *layout[:3], seed=31, half=True)
    wide = QuantizedTensor(half.values, half.scales.float(), half.mins.float(), *layout[:2])
    assert half.half_scales and not wide.half_scales
    for batch in BATCHES:
        x = make_input(batch, 288, seed=batch)
        assert torch.equal(quantized_linear(x, half, None), quantized_linear(x, wide, None))
    assert torch.equal(matmul.dequantize(half), matmul.dequantize(wide))
    assert torch.equal(half.dequantize(), wide.dequantize())


def test_non_contiguous_fields_are_multiplied_correctly(kernels):
    """A QuantizedTensor built from strided views must give the same product as one built
    from contiguous copies: the kernels read raw pointers, so the layout is made packed."""
    weight, exact = make_weight(8, 128, 8, 32, True, seed=41)
    strided = QuantizedTensor(
        weight.values.t().contiguous().t(),
        weight.scales.t().contiguous().t(),
        weight.mins.t().contiguous().t(),
        weight.bits,
        weight.group_size,
    )
    for batch in (2, 12):
        x = make_input(batch, 128, seed=42)
        out = quantized_linear(x, strided, None)
        bound = dot_path_bound(x, weight, exact, None)
        assert_within(out, reference(x, exact, None), bound, f"strided weight, batch {batch}")
    assert torch.equal(matmul.dequantize(strided), matmul.dequantize(weight))


def _clear_kernel_caches() -> None:
    native.kernels.cache_clear()
    for value in vars(native).values():  # any other functools cache a later version adds
        if isinstance(value, functools._lru_cache_wrapper):
            value.cache_clear()


def test_missing_compiler_is_reported(monkeypatch, tmp_path):
    """CC naming a compiler that does not exist: `build` raises KernelBuildError naming it,
    `kernels()` is None (layers fall back to torch) and `unavailable_reason` says why.
    The caches are cleared afterwards so later tests get the real kernel again."""
    try:
        with monkeypatch.context() as patch:
            patch.setenv("CC", "/nonexistent/cc")
            patch.setenv("PAGEDKV_CACHE", str(tmp_path))
            _clear_kernel_caches()
            with pytest.raises(native.KernelBuildError, match="/nonexistent/cc"):
                native.build()
            assert native.kernels() is None
            reason = native.unavailable_reason()
            assert reason is not None and "/nonexistent/cc" in reason
    finally:
        _clear_kernel_caches()
    if native.kernels() is not None:  # the real compiler again, when this machine has one
        assert native.unavailable_reason() is None


def test_failing_compiler_leaves_no_library(monkeypatch, tmp_path):
    """A compiler that runs but fails (`false`): KernelBuildError quoting the command, and no
    file under the final library name, so the next start tries again rather than loading it."""
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` program")
    try:
        with monkeypatch.context() as patch:
            patch.setenv("CC", false)
            patch.setenv("PAGEDKV_CACHE", str(tmp_path))
            _clear_kernel_caches()
            with pytest.raises(native.KernelBuildError, match="false.*failed"):
                native.build()
            assert native.kernels() is None
            assert "failed" in (native.unavailable_reason() or "")
            assert not list(tmp_path.rglob("*.so"))
    finally:
        _clear_kernel_caches()
