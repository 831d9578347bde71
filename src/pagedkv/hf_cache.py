"""The local Hugging Face cache: the folder of a Hub repo id that is already downloaded.

vLLM scripts name models by repo id (`LLM("Qwen/Qwen2.5-0.5B-Instruct")`) and vLLM downloads
them into the Hugging Face cache. pagedkv fetches nothing from the Hub, but it reads a repo
that is already there, so a machine where transformers or vLLM has run loads the same name
with no path. The cache is huggingface_hub's: each repo a `models--ORG--NAME` folder holding
`refs/REVISION` (a file with a commit hash) and `snapshots/COMMIT/` (the repo's files). It lies
in vLLM's `download_dir` when one is given (vLLM downloads there), else $HF_HUB_CACHE, else
$HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub, as
huggingface_hub reads them. A revision is a branch or tag (read from `refs/`) or a commit hash.

vLLM names a GGUF file of a repo by `REPO_ID:QUANT_TYPE` (`unsloth/Qwen3-0.6B-GGUF:Q4_K_M`);
the same name picks the file from the cached snapshot, by vLLM's rule (`gguf_file`).
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

DEFAULT_REVISION = "main"
# A Hub repo id: a name, or an owner and a name ("gpt2", "Qwen/Qwen2.5-0.5B-Instruct"), each
# 1-96 of letters, digits, "_", "." and "-", starting and ending with a letter, digit or "_".
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"(?:{_PART}/)?{_PART}")
# Size suffixes of GGUF quant types in file names, as vLLM reads them (Q4_K_M: Q4_K, medium).
_QUANT_SUFFIXES = ("_M", "_S", "_L", "_XL", "_XS", "_XXS")
# The parts of a GGUF file split by llama.cpp's gguf-split: NAME-00001-of-00003.gguf.
_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


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


def split_gguf_name(name: str) -> tuple[str, str] | None:
    """vLLM's `OWNER/NAME:QUANT_TYPE` as its repo id and quant type, or None when `name` is not
    spelled so. A quant type is a GGML type's name (Q4_K, IQ4_XS, F16), one with a size suffix
    (Q4_K_M) or one with a dash-separated prefix (UD-Q4_K_XL)."""
    repo_id, colon, quant_type = name.rpartition(":")
    if not colon or "/" not in repo_id or not is_repo_id(repo_id):
        return None
    if re.fullmatch(r"[A-Za-z0-9_+-]+", quant_type) is None:
        return None
    known = _is_quant_type(quant_type) or _is_quant_type(quant_type.rpartition("-")[2])
    return (repo_id, quant_type) if known else None


def _is_quant_type(name: str) -> bool:
    from gguf import GGMLQuantizationType  # numpy's import, paid only for a name with a colon

    bases = [name] + [name[: -len(s)] for s in _QUANT_SUFFIXES if name.endswith(s)]
    return any(base in GGMLQuantizationType.__members__ for base in bases)


def cached_model(
    name: str, revision: str | None = None, download_dir: str | Path | None = None
) -> Path | None:
    """Where model `name` lies in the cache: a repo id's snapshot folder, or the GGUF file an
    `OWNER/NAME:QUANT_TYPE` name picks from its repo's; None when the cache has no such repo."""
    gguf_name = split_gguf_name(name)
    folder = snapshot(name if gguf_name is None else gguf_name[0], revision, download_dir)
    if folder is None or gguf_name is None:
        return folder
    return gguf_file(folder, *gguf_name)


def fetch_command(name: str) -> str | None:
    """The command that downloads model `name` into the cache, or None: not a Hub name."""
    gguf_name = split_gguf_name(name)
    if gguf_name is not None:
        return f'hf download {gguf_name[0]} --include "*-{gguf_name[1]}*.gguf"'
    return f"hf download {name}" if is_repo_id(name) else None


def gguf_file(folder: Path, repo_id: str, quant_type: str) -> Path:
    """The GGUF file of `quant_type` in snapshot `folder`, as vLLM picks it: a name ending in
    `-QUANT_TYPE.gguf` or holding `-QUANT_TYPE-`, at the top or one folder down, the one with
    fewest dashes first (a whole file before split parts), then by name."""
    patterns = [f"*-{quant_type}.gguf", f"*-{quant_type}-*.gguf"]
    patterns += [f"*/{pattern}" for pattern in patterns]
    files = sorted(str(path.relative_to(folder)) for path in folder.rglob("*.gguf"))
    matching = [file for file in files if any(fnmatch.fnmatchcase(file, p) for p in patterns)]
    if not matching:
        raise ValueError(
            f"{repo_id!r} in the Hugging Face cache ({folder}) has no GGUF file of quant type "
            f"{quant_type!r} (its .gguf files: {', '.join(files) or 'none'}); pagedkv downloads "
            f"nothing: fetch it first, e.g. `{fetch_command(f'{repo_id}:{quant_type}')}`"
        )
    chosen = min(matching, key=lambda file: (file.count("-"), file))
    if _SPLIT_PART.search(chosen):
        raise ValueError(
            f"{repo_id}:{quant_type} is split into parts ({chosen}, ...): pagedkv reads a GGUF "
            "model from one file (merge the parts with llama.cpp's `llama-gguf-split --merge`)"
        )
    return folder / chosen


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
