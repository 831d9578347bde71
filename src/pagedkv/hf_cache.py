"""The local Hugging Face cache: the folder of a Hub repo id that is already downloaded.

vLLM scripts name models by repo id (`LLM("Qwen/Qwen2.5-0.5B-Instruct")`) and vLLM downloads
them into the Hugging Face cache. pagedkv fetches nothing from the Hub, but it reads a repo
that is already there, so a machine where transformers or vLLM has run loads the same name
with no path. The cache is huggingface_hub's: each repo a `models--ORG--NAME` folder holding
`refs/REVISION` (a file with a commit hash) and `snapshots/COMMIT/` (the repo's files). It lies
in vLLM's `download_dir` when one is given (vLLM downloads there), else $HF_HUB_CACHE, else
$HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub, as
huggingface_hub reads them. A revision is a branch or tag (read from `refs/`) or a commit hash.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

DEFAULT_REVISION = "main"
# A Hub repo id: a name, or an owner and a name ("gpt2", "Qwen/Qwen2.5-0.5B-Instruct"), each
# 1-96 of letters, digits, "_", "." and "-", starting and ending with a letter, digit or "_".
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"(?:{_PART}/)?{_PART}")


def hub_cache(download_dir: str | Path | None = None) -> Path:
    """The folder huggingface_hub keeps repos in (the module says which)."""
    if download_dir is not None:
        return Path(download_dir).expanduser()
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.path.expandvars(os.environ[variable])).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(os.path.expandvars(home)).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache").expanduser() / "huggingface" / "hub"


def is_repo_id(name: str) -> bool:
    """Whether `name` is spelled as the Hub spells a repo id (a name, or OWNER/NAME; no "--"
    or "..", no ".git" at the end)."""
    return (
        _REPO_ID.fullmatch(name) is not None
        and "--" not in name
        and ".." not in name
        and not name.endswith(".git")
    )


def snapshot(
    repo_id: str, revision: str | None = None, download_dir: str | Path | None = None
) -> Path | None:
    """The folder of `repo_id` at `revision` (None: main) in the cache, or None when the cache
    holds no such repo; raise RevisionNotCached when it holds the repo but not that revision."""
    if not is_repo_id(repo_id):
        return None
    repo = hub_cache(download_dir) / ("models--" + repo_id.replace("/", "--"))
    if not repo.is_dir():
        return None
    wanted = DEFAULT_REVISION if revision is None else revision
    if not wanted or ".." in Path(wanted).parts or Path(wanted).is_absolute():
        raise ValueError(f"revision {revision!r} is not a branch, tag or commit hash")
    ref = repo / "refs" / wanted
    commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else wanted
    folder = repo / "snapshots" / commit
    if not folder.is_dir():
        raise RevisionNotCached(repo_id, wanted, repo)
    return folder


class RevisionNotCached(ValueError):
    """The cache holds a repo, but not the revision asked for."""

    def __init__(self, repo_id: str, revision: str, repo: Path) -> None:
        refs = repo / "refs"
        branches = (
            sorted(str(ref.relative_to(refs)) for ref in refs.rglob("*") if ref.is_file())
            if refs.is_dir()
            else []
        )
        held = ", ".join(branches) or "none"
        super().__init__(
            f"{repo_id!r} is in the Hugging Face cache ({repo}) without revision {revision!r} "
            f"(branches and tags held: {held}); pagedkv downloads nothing: fetch that revision "
            f"first, e.g. `hf download {repo_id} --revision {revision}`"
        )
