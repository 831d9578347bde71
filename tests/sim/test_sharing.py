"""Sharing one prompt among sequences: the issue's 13 blocks instead of 130, 936 MiB."""

from pagedkv.kvmath.presets import resolve_model
from pagedkv.kvmath.spec import MiB
from pagedkv.sim.sharing import shared_prompt_blocks


def test_ten_sequences_of_a_200_token_prompt_on_gpt_tutorial():
    bytes_per_block = resolve_model("gpt-tutorial").spec.bytes_per_block(16)
    assert bytes_per_block == 16 * 512 * 1024  # 8 MiB
    report = shared_prompt_blocks(10, 200, 16, bytes_per_block)
    # 200 tokens = 12 full blocks + 8 tokens: 13 blocks per copy.
    assert report.unshared_blocks == 10 * 13 == 130
    # A fork shares all 13, the partial block too.
    assert report.forked_blocks == 13
    assert report.forked_bytes_saved == 117 * 8 * MiB == 936 * MiB
    # Prefix caching shares only the 12 full blocks; each keeps its own partial block.
    assert report.prefix_cached_blocks == 12 + 10
    assert report.prefix_cached_bytes_saved == 108 * 8 * MiB
    # After one token each, 9 samples copy the shared partial block on write; the last
    # writer owns it by then, in place.
    assert report.cow_copies == 9
    assert report.forked_after_first_token_blocks == 12 + 10


def test_a_prompt_of_whole_blocks_shares_fully_under_prefix_caching_too():
    report = shared_prompt_blocks(4, 64, 16, 1)
    assert report.unshared_blocks == 16
    # The hit is capped one token short of the prompt, so the 4th block is recomputed.
    assert report.prefix_cached_blocks == 3 + 4
    assert report.forked_blocks == 4
    assert report.forked_after_first_token_blocks == 4 + 4  # each token opens a new block
    assert report.cow_copies == 0
