"""`pagedkv convert FILE.gguf DIR`: write a GGUF model as a standard Hugging Face folder.

The folder holds float32 safetensors, config.json, tokenizer.json, tokenizer_config.json (with
the chat template) and generation_config.json; transformers and `pagedkv --model DIR` load it.
FILE may also be a built-in model name, pulled first, or vLLM's name of a GGUF file in the
local Hugging Face cache (REPO_ID:QUANT_TYPE or REPO_ID/PATH.gguf).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pagedkv.hub import BUILTIN_MODELS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the source file and target folder of `pagedkv convert`."""
    parser.add_argument(
        "source",
        help=f"a .gguf file, a built-in model name ({', '.join(BUILTIN_MODELS)}), or "
        "REPO_ID:QUANT_TYPE or REPO_ID/PATH.gguf of a GGUF file in the Hugging Face cache",
    )
    parser.add_argument("folder", type=Path, help="new folder to write (must not hold files)")


def run(args: argparse.Namespace) -> int:
    """Convert; print where the folder is and how long it took; exit 1 with the reason."""
    from pagedkv.hf_cache import HubCacheError
    from pagedkv.hub import HubError, pull
    from pagedkv.model.errors import ModelError
    from pagedkv.weights.gguf.convert import convert_gguf
    from pagedkv.weights.load import find_source

    start = time.perf_counter()
    source = Path(args.source)
    try:
        source = find_source(args.source, None, None) or pull(args.source)
        folder = convert_gguf(source, args.folder)
    except (ModelError, HubError, HubCacheError) as error:
        print(f"pagedkv convert: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # the source it cannot read, or a target it cannot write
        side = f"read {source}" if error.filename == str(source) else f"write {args.folder}"
        print(f"pagedkv convert: error: cannot {side}: {error.strerror or error}", file=sys.stderr)
        return 1
    print(f"wrote {folder} in {time.perf_counter() - start:.1f} s")
    return 0
