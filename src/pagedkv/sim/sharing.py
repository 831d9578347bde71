"""How many physical blocks N sequences with one common prompt hold, shared three ways.

The prompt's last block is usually partly filled (200 tokens = 12 full blocks of 16 + 8).
- unshared: every sequence holds its own copy, N x 13 blocks;
- prefix caching: separate requests share only full blocks, so each still computes and
  holds its own partial last block: 12 + N. Counted for N requests that arrive at once and
  are prefilled in one step, as the engine's scheduler drives the manager: each prompt's full
  blocks are published when its chunk is scheduled (`mark_scheduled`), and the next prompt
  admitted in the step hits them. Requests that come in turn share the same blocks;
- fork: samples of one request (parallel sampling, n = N) share every block, the partial
  one too, 13 in all, until each writes its first token and copy-on-write gives it a
  private copy of that last block.
All counts are read off a `KVCacheManager` driven through exactly those calls.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedkv.memory import KVCacheManager


@dataclass(frozen=True)
class SharingReport:
    """Physical blocks held by `num_sequences` sequences of one `prompt_tokens`-token prompt."""

    num_sequences: int
    prompt_tokens: int
    block_size: int
    bytes_per_block: int
    unshared_blocks: int
    prefix_cached_blocks: int
    forked_blocks: int
    forked_after_first_token_blocks: int
    cow_copies: int

    @property
    def forked_bytes_saved(self) -> int:
        """Bytes a fork saves over unshared copies of the prompt."""
        return (self.unshared_blocks - self.forked_blocks) * self.bytes_per_block

    @property
    def prefix_cached_bytes_saved(self) -> int:
        """Bytes prefix caching saves over unshared copies of the prompt."""
        return (self.unshared_blocks - self.prefix_cached_blocks) * self.bytes_per_block

    def to_dict(self) -> dict[str, object]:
        """JSON-ready values, savings included."""
        return {
            **asdict(self),
            "forked_bytes_saved": self.forked_bytes_saved,
            "prefix_cached_bytes_saved": self.prefix_cached_bytes_saved,
        }


def shared_prompt_blocks(
    num_sequences: int, prompt_tokens: int, block_size: int, bytes_per_block: int
) -> SharingReport:
    """Drive a manager through each way of sharing and count the blocks held."""
    prompt = list(range(prompt_tokens))
    blocks_per_prompt = -(-prompt_tokens // block_size)
    pool = num_sequences * (blocks_per_prompt + 1)

    unshared = KVCacheManager(pool, block_size, enable_prefix_caching=False)
    for seq in range(num_sequences):
        unshared.allocate(seq, prompt)
        unshared.mark_computed(seq, prompt_tokens)

    cached = KVCacheManager(pool, block_size, enable_prefix_caching=True)
    for seq in range(num_sequences):
        cached.allocate(seq, prompt)
        cached.mark_scheduled(seq, prompt_tokens)
    cached.commit_scheduled()
    for seq in range(num_sequences):
        cached.mark_computed(seq, prompt_tokens)

    forked = KVCacheManager(pool, block_size, enable_prefix_caching=True)
    forked.allocate(0, prompt)
    forked.mark_computed(0, prompt_tokens)
    for seq in range(1, num_sequences):
        forked.fork(0, seq)
    forked_blocks = _held(forked)
    for seq in range(num_sequences):
        forked.append(seq, [prompt_tokens + seq])

    return SharingReport(
        num_sequences=num_sequences,
        prompt_tokens=prompt_tokens,
        block_size=block_size,
        bytes_per_block=bytes_per_block,
        unshared_blocks=_held(unshared),
        prefix_cached_blocks=_held(cached),
        forked_blocks=forked_blocks,
        forked_after_first_token_blocks=_held(forked),
        cow_copies=forked.stats.cow_copies,
    )


def _held(manager: KVCacheManager) -> int:
    return manager.num_gpu_blocks - manager.num_free_blocks
