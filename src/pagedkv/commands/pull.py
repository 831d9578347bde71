"""`pagedkv pull NAME`: download a built-in model into the local cache, ready to run.

Pulling also converts the GGUF file into a float32 folder once, so the first `generate` or
`serve` afterwards starts in seconds; `--no-convert` keeps only the download.
"""

from __future__ import annotations

import argparse
import sys

from pagedkv.hub import BUILTIN_MODELS, DEFAULT_MODEL, cache_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the model name and the options of `pagedkv pull`."""
    names = ", ".join(BUILTIN_MODELS)
    parser.add_argument(
        "name",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"built-in model to fetch (default: {DEFAULT_MODEL}; built-in: {names})",
    )
    parser.add_argument(
        "--force", action="store_true", help="download again even if the file is cached"
    )
    parser.add_argument(
        "--no-convert",
        action="store_true",
        help="only download and verify; convert on first use instead",
    )
    parser.epilog = f"The cache is {cache_dir()} ($PAGEDKV_CACHE or $XDG_CACHE_HOME override it)."


def run(args: argparse.Namespace) -> int:
    """Pull (and convert) the model; print each step; exit 2 for a name that is no built-in
    model, 1 with the reason when the pull fails."""
    from pagedkv.hub import BUILTIN_MODELS, HubError, pull
    from pagedkv.model.errors import ModelError

    if args.name not in BUILTIN_MODELS:
        print(
            f"pagedkv pull: error: {args.name!r} is not a built-in model (built-in: "
            f"{', '.join(BUILTIN_MODELS)}); a folder or a .gguf file needs no pull",
            file=sys.stderr,
        )
        return 2
    try:
        path = pull(args.name, force=args.force)
        if not args.no_convert:
            from pagedkv.weights.load import converted_folder

            path = converted_folder(args.name)
    except (ModelError, HubError) as error:
        print(f"pagedkv pull: error: {error}", file=sys.stderr)
        return 1
    print(f"{args.name}: ready in {path}")
    return 0
