"""vLLM's newer `vllm.utils.argparse_utils` import path of `FlexibleArgumentParser`."""

from pagedkv.cli import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
