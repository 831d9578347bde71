"""`python -m pagedkv ...` runs the `pagedkv` command, for an environment whose scripts folder
is not on PATH (as `python -m vllm.entrypoints.cli.main` does for vLLM)."""

from pagedkv.cli import main

raise SystemExit(main())
