"""Triton paged attention against a dense float64 oracle, decode and prefill.

On a CPU these run under ``TRITON_INTERPRET=1`` (see conftest.py); on a GPU, compiled. The
oracle reads the same (possibly bf16) cache values in float64, so the tolerance is the kernel's
own rounding: float32 sums, and for bf16 the probabilities and the output rounded to bf16.
"""

from __future__ import annotations

import pytest
import torch

from tests.attention.triton.paged_batch import PagedBatch, dense_attention, make_batch

pytest.importorskip("triton")

from pagedkv.attention.triton.attention import DecodeConfig, triton_paged_attention  # noqa: E402

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
DTYPES = (torch.float32, torch.bfloat16)


def layouts(window: int) -> list[tuple[int, int, int | None, torch.dtype]]:
    """(block_size, group, sliding_window, dtype): every block size, group and window together,
    each in one dtype, the dtypes alternating so that each meets every block size, group and
    window (the dtype changes only how values are loaded, rounded and stored)."""
    return [
        (block_size, group, sliding_window, DTYPES[(b + g + w) % 2])
        for b, block_size in enumerate((16, 32))
        for g, group in enumerate((1, 2, 4))
        for w, sliding_window in enumerate((None, window))
    ]


def dtype_id(value: object) -> str | None:
    """A dtype's name in a case's id (pytest's own id for the other values)."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


# Small partitions, so short test contexts still split into several and get merged; several
# programs per KV head stride through the work list (on the CPU the "SM count" is 1).
SMALL_PARTITIONS = DecodeConfig(partition_size=64, block_n=32, programs_per_sm=6)


def run_both(
    batch: PagedBatch,
    device: torch.device,
    dtype: torch.dtype,
    sliding_window: int | None,
    scale: float = 0.25,
    config: DecodeConfig = SMALL_PARTITIONS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, oracle output), both float64 on the CPU."""
    ours = batch.to(device, dtype)
    out = triton_paged_attention(
        ours.query,
        ours.k_cache,
        ours.v_cache,
        ours.block_tables,
        ours.context_lens,
        ours.query_start_loc,
        batch.max_query_len,
        batch.max_context_len,
        scale,
        sliding_window,
        decode_config=config,
    )
    assert out.dtype == dtype and out.shape == batch.query.shape
    expected = dense_attention(batch.to(torch.device("cpu"), dtype), scale, sliding_window)
    return out.double().cpu(), expected


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Every element written, finite and within the dtype's tolerance."""
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize(
    ("block_size", "group", "sliding_window", "dtype"), layouts(100), ids=dtype_id
)
def test_decode_matches_reference(
    device: torch.device, block_size: int, group: int, sliding_window: int | None, dtype
) -> None:
    """One token per sequence; mixed lengths from 1 key to several partitions.

    The window (100 keys) spans two 64-key partitions, starting mid-block, for the longer ones.
    """
    context_lens = [1, 17, 64, 300, 33, 129]
    batch = make_batch(
        context_lens,
        [1] * len(context_lens),
        block_size=block_size,
        num_kv_heads=2,
        group=group,
        head_dim=32,
        dtype=torch.float32,
        seed=block_size + group,
    )
    assert_matches(*run_both(batch, device, dtype, sliding_window), dtype)


@pytest.mark.parametrize(
    ("block_size", "group", "sliding_window", "dtype"), layouts(24), ids=dtype_id
)
def test_prefill_matches_reference(
    device: torch.device, block_size: int, group: int, sliding_window: int | None, dtype
) -> None:
    """Whole prompts, chunks after a cached prefix, and decode tokens in one flat batch."""
    #              prompt  cached+chunk  decode  1-token prompt  long cached+chunk
    context_lens = [23, 49, 6, 1, 170]
    query_lens = [23, 9, 1, 1, 70]
    batch = make_batch(
        context_lens,
        query_lens,
        block_size=block_size,
        num_kv_heads=2,
        group=group,
        head_dim=32,
        dtype=torch.float32,
        seed=block_size * group,
    )
    assert_matches(*run_both(batch, device, dtype, sliding_window), dtype)


@pytest.mark.parametrize("max_query_len", [1, 5])
def test_group_and_head_dim_not_powers_of_two(device: torch.device, max_query_len: int) -> None:
    """3 query heads per KV head (Qwen2 has 7) and head_dim 40: padded, masked on load/store."""
    batch = make_batch(
        [70, 5],
        [max_query_len, 1],
        block_size=16,
        num_kv_heads=2,
        group=3,
        head_dim=40,
        dtype=torch.float32,
    )
    assert_matches(*run_both(batch, device, torch.float32, None), torch.float32)


def test_decode_default_config_splits_long_contexts(device: torch.device) -> None:
    """The shipped partition size: one sequence over three partitions beside a short one."""
    batch = make_batch(
        [1100, 40],
        [1, 1],
        block_size=16,
        num_kv_heads=2,
        group=2,
        head_dim=32,
        dtype=torch.float32,
    )
    out, expected = run_both(batch, device, torch.float32, None, config=DecodeConfig())
    assert_matches(out, expected, torch.float32)


def test_window_skips_keys_outside_it(device: torch.device) -> None:
    """Keys that slid out of the window are never read: poisoning them changes nothing."""
    batch = make_batch(
        [200], [1], block_size=16, num_kv_heads=1, group=1, head_dim=32, dtype=torch.float32
    )
    out, expected = run_both(batch, device, torch.float32, 20)
    poisoned_blocks = batch.block_tables[0, : (200 - 20) // 16].long()
    batch.k_cache[poisoned_blocks] = float("nan")
    batch.v_cache[poisoned_blocks] = float("nan")
    poisoned_out, _ = run_both(batch, device, torch.float32, 20)
    assert_matches(out, expected, torch.float32)
    assert torch.equal(poisoned_out, out)


def test_rejects_mismatched_dtypes(device: torch.device) -> None:
    """A cache in another dtype than the query is an error naming both."""
    batch = make_batch(
        [4], [4], block_size=16, num_kv_heads=1, group=1, head_dim=16, dtype=torch.float32
    )
    with pytest.raises(ValueError, match="differ in dtype"):
        triton_paged_attention(
            batch.query.to(device),
            batch.k_cache.to(device, torch.bfloat16),
            batch.v_cache.to(device, torch.bfloat16),
            batch.block_tables.to(device),
            batch.context_lens.to(device),
            batch.query_start_loc.to(device),
            4,
            4,
            1.0,
        )
