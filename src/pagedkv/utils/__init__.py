"""vLLM's `vllm.utils` import path of `FlexibleArgumentParser`, which vLLM's example scripts
import to parse engine flags (`pagedkv.cli`'s, reading a command line as `pagedkv` does)."""

from pagedkv.cli import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
