"""A Hugging Face cache laid out by hand, as huggingface_hub lays it out, for tests of models,
tokenizers, GGUF files and LoRA adapters named by Hub repo id (`pagedkv/hf_cache.py`)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def commit_of(label: str) -> str:
    """A 40-digit commit hash, as the Hub names snapshots."""
    return hashlib.sha1(label.encode()).hexdigest()


def cache_repo(cache: Path, repo_id: str, snapshots: dict[str, Path], refs: dict[str, str]) -> Path:
    """Lay model folders out in `cache` as huggingface_hub does: `snapshots` maps a commit to a
    folder whose files become blobs (named by their hash) linked from `snapshots/COMMIT/`;
    `refs` maps a branch or tag to a commit, each written to `refs/NAME`."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for commit, folder in snapshots.items():
        for file in folder.rglob("*"):
            if file.is_file():
                data = file.read_bytes()
                blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
                blob.parent.mkdir(parents=True, exist_ok=True)
                blob.write_bytes(data)
                link = repo / "snapshots" / commit / file.relative_to(folder)
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(os.path.relpath(blob, link.parent))
    for name, commit in refs.items():
        ref = repo / "refs" / name
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)  # no newline, as huggingface_hub writes it
    return repo
