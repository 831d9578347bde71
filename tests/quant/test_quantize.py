"""Float weights -> QuantizedTensor (`quantize_int8`, `quantize_int4`) and `common_layout`.

Round to nearest means every weight comes back within half a quantisation step of itself:
`|w - dequantize(w)| <= scale / 2`, where `scale` is the group's step. Float32 adds a little:
`w / scale` is rounded before it is rounded to an integer (up to 127 or 15 steps, so a
relative eps of that many steps) and `scale * q + min` is rounded twice (eps of each term).
The slack below is twice that, computed in float64 per element.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.quant.formats import QuantizedTensor
from pagedkv.quant.quantize import common_layout, quantize, quantize_int4, quantize_int8

EPS32 = torch.finfo(torch.float32).eps


def random_weight(rows: int, groups: int, seed: int) -> torch.Tensor:
    """Random `[rows, 32 * groups]` weights with group scales from 1e-6 to 1e4, an offset per
    group (so int4's min matters), one constant group, one all-zero group and one group with a
    single non-zero value, when there are enough groups."""
    gen = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-6, 5, (rows, groups, 1), generator=gen).to(torch.float32)
    scale = 10.0**exponents
    offset = torch.randn(rows, groups, 1, generator=gen) * scale
    weight = torch.randn(rows, groups, 32, generator=gen) * scale + offset
    if rows * groups >= 3:
        flat = weight.view(-1, 32)
        flat[0] = -0.37  # constant
        flat[1] = 0.0  # all zero
        flat[2] = 0.0
        flat[2, 5] = 3.0  # one spike: everything else must come back as exactly 0
    return weight.view(rows, groups * 32)


def per_element(tensor: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """A per-group `[rows, groups]` tensor repeated to `[rows, cols]`, in float64."""
    return tensor.double().repeat_interleave(group_size, dim=1)


def assert_round_trip(weight: torch.Tensor, qt: QuantizedTensor, steps: int) -> None:
    """Every element within scale / 2 of its original, plus float32 slack (module docstring)."""
    dense = qt.dequantize()
    assert not dense.isnan().any() and not qt.scales.isnan().any() and not qt.mins.isnan().any()
    w = weight.double()
    scale = per_element(qt.scales)
    mins = per_element(qt.mins)
    slack = 2 * EPS32 * (steps * scale + w.abs() + mins.abs())
    error = (dense.double() - w).abs()
    over = error > scale / 2 + slack
    assert not over.any(), (
        f"{int(over.sum())} elements beyond half a step, e.g. {error[over][0]:.3g} "
        f"with step {scale[over][0]:.3g}"
    )


@settings(deadline=None, max_examples=30, derandomize=True)
@given(rows=st.integers(1, 40), groups=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_int8_round_trip(rows, groups, seed):
    """int8: symmetric groups of 32, values in -127..127, no mins, within half a step."""
    weight = random_weight(rows, groups, seed)
    qt = quantize_int8(weight)
    assert (qt.bits, qt.group_size, qt.shape) == (8, 32, tuple(weight.shape))
    assert qt.values.dtype == torch.int8
    values = qt.values.to(torch.int16)
    assert int(values.min()) >= -127 and int(values.max()) <= 127
    assert not qt.has_mins and not qt.mins.any()
    # the step is amax / 127: the largest magnitude of each group lands on +-127 exactly
    amax = weight.view(rows, groups, 32).abs().amax(-1)
    torch.testing.assert_close(qt.scales, amax / 127, rtol=0, atol=0)
    assert_round_trip(weight, qt, steps=127)


@settings(deadline=None, max_examples=30, derandomize=True)
@given(rows=st.integers(1, 40), groups=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_int4_round_trip(rows, groups, seed):
    """int4: groups of 32 with a scale and a min, values in 0..15, within half a step; the
    step is (max - min) / 15, so it is 15x coarser than int8's at the same range."""
    weight = random_weight(rows, groups, seed)
    qt = quantize_int4(weight)
    assert (qt.bits, qt.group_size, qt.shape) == (4, 32, tuple(weight.shape))
    assert qt.values.dtype == torch.uint8 and qt.values.shape == (rows, groups * 16)
    q = qt.integers()
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    grouped = weight.view(rows, groups, 32)
    low, high = grouped.amin(-1), grouped.amax(-1)
    assert torch.equal(qt.mins, low)
    torch.testing.assert_close(qt.scales, (high - low) / 15, rtol=0, atol=0)
    assert_round_trip(weight, qt, steps=15)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_degenerate_groups(scheme):
    """All-zero groups give scale 0 and exact zeros (no 0/0 NaN); a constant group comes back
    as its constant (int4 exactly: step 0, min the constant; int8 within one rounding); a lone
    spike leaves the rest of its group at exactly 0."""
    weight = torch.zeros(3, 96)
    weight[0, 32:64] = -0.37
    weight[1, 64 + 5] = 3.0
    qt = quantize(weight, scheme)
    dense = qt.dequantize()
    assert not dense.isnan().any()
    assert torch.equal(dense[2], torch.zeros(96))
    assert torch.equal(dense[0, :32], torch.zeros(32)) and torch.equal(
        qt.scales[0, 0], torch.tensor(0.0)
    )
    if scheme == "int4":
        assert torch.equal(dense[0, 32:64], weight[0, 32:64])
    else:
        torch.testing.assert_close(dense[0, 32:64], weight[0, 32:64], rtol=2 * EPS32, atol=0)
    spike = dense[1, 64:96]
    torch.testing.assert_close(spike[5], torch.tensor(3.0), rtol=2 * EPS32, atol=0)
    assert torch.equal(torch.cat((spike[:5], spike[6:])), torch.zeros(31))


def test_int4_nibble_order():
    """Byte j of a group holds value j in its low nibble and value j + 16 in its high one
    (ggml's Q4_0 order), checked on the raw bytes rather than through `integers()`."""
    up, down = torch.arange(16.0), 15 - torch.arange(16.0)  # min 0, max 15: a step of 1
    group = torch.cat((up, down))
    qt = quantize_int4(torch.stack((group, torch.cat((down, up)))))
    j = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(qt.values[0], j | ((15 - j) << 4))
    assert torch.equal(qt.values[1], (15 - j) | (j << 4))
    assert torch.equal(qt.dequantize()[0], group)


@pytest.mark.parametrize("cols", [16, 48, 33, 100])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_columns_not_a_multiple_of_32_are_refused(scheme, cols):
    """Groups of 32 need whole groups: anything else is a ValueError, not a silent reshape."""
    with pytest.raises(ValueError, match="groups of 32"):
        quantize(torch.randn(4, cols), scheme)


def test_unknown_scheme_is_refused():
    with pytest.raises(ValueError, match="int8"):
        quantize(torch.randn(2, 32), "int3")


def make_part(rows: int, cols: int, bits: int, group: int, seed: int) -> QuantizedTensor:
    """A random QuantizedTensor with mins (every field exercised), full integer range."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        values = torch.randint(0, 256, (rows, cols // 2), generator=gen).to(torch.uint8)
    else:
        values = torch.randint(-128, 128, (rows, cols), generator=gen).to(torch.int8)
    groups = (rows, cols // group)
    return QuantizedTensor(
        values, torch.randn(groups, generator=gen), torch.randn(groups, generator=gen), bits, group
    )


MIXES = {
    "4/32+8/16+8/32": ((4, 32), (8, 16), (8, 32)),
    "4/32+8/32": ((4, 32), (8, 32)),
    "8/32+8/16": ((8, 32), (8, 16)),
    "4/32+8/16": ((4, 32), (8, 16)),
    "4/32+4/32": ((4, 32), (4, 32)),
    "8/16 alone": ((8, 16),),
}


@pytest.mark.parametrize("mix", MIXES.values(), ids=MIXES.keys())
def test_common_layout_is_exact(mix):
    """Stacking parts of different layouts (a Q4_K_M file's q/k beside a Q6_K v) re-packs
    them losslessly: the result dequantises to exactly the row concatenation of each part's
    own dequantisation, in the widest width and the smallest group of the set."""
    parts = [
        make_part(rows, 64, bits, group, seed)
        for seed, (rows, (bits, group)) in enumerate(zip((5, 3, 8), mix, strict=False))
    ]
    combined = common_layout(parts)
    assert combined.bits == max(bits for bits, _ in mix)
    assert combined.group_size == min(group for _, group in mix)
    assert combined.shape == (sum(part.shape[0] for part in parts), 64)
    assert torch.equal(combined.dequantize(), torch.cat([part.dequantize() for part in parts]))
