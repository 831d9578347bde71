"""The local Hugging Face cache: the folder of a Hub repo id that is already downloaded.

vLLM scripts name models by repo id (`LLM("Qwen/Qwen2.5-0.5B-Instruct")`) and vLLM downloads
them into the Hugging Face cache. pagedkv fetches nothing from the Hub, but it reads a repo
that is already there, so a machine where transformers or vLLM has run loads the same name
with no path. The cache is huggingface_hub's: each repo a `models--ORG--NAME` folder holding
`refs/REVISION` (a file with a commit hash) and `snapshots/COMMIT/` (the repo's files). It lies
in vLLM's `download_dir` when one is given (vLLM downloads there), else where huggingface_hub
puts it: $HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else
$XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub. A revision is a branch or tag
(read from `refs/`) or a commit hash.

vLLM names a GGUF file of a repo by `REPO_ID:QUANT_TYPE` (`unsloth/Qwen3-0.6B-GGUF:Q4_K_M`,
picked by vLLM's rule, `gguf_in_snapshot`) or by `REPO_ID/PATH.gguf`; the same names pick the
file from the cached snapshot.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_REVISION = "main"
# A Hub repo id, as huggingface_hub validates it: a name, or an owner and a name ("gpt2",
# "Qwen/Qwen2.5-0.5B-Instruct"), each 1-96 ASCII letters, digits, "_", "." and "-", starting
# and ending with a letter, digit or "_".
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"(?:{_PART}/)?{_PART}")
# Size suffixes of GGUF quant types in file names, as vLLM reads them (Q4_K_M: Q4_K, medium).
_QUANT_SUFFIXES = ("_M", "_S", "_L", "_XL", "_XS", "_XXS")
# The parts of a GGUF file split by llama.cpp's gguf-split: NAME-00001-of-00003.gguf.
_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def hub_cache(download_dir: str | Path | None = None) -> Path:
    """The folder repos are read from: `download_dir`, else huggingface_hub's (its variables
    read and expanded as huggingface_hub reads them)."""
    if download_dir is not None:
        return Path(download_dir).expanduser()
    user_cache = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    home = _expanded(os.environ.get("HF_HOME", os.path.join(user_cache, "huggingface")))
    legacy = os.environ.get("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub"))
    return Path(_expanded(os.environ.get("HF_HUB_CACHE", legacy)))


def _expanded(path: str) -> str:
    return os.path.expandvars(os.path.expanduser(path))


def is_repo_id(name: str) -> bool:
    """Whether `name` is spelled as the Hub spells a repo id (a name, or OWNER/NAME; no "--"
    or "..", no ".git" at the end)."""
    return (
        _REPO_ID.fullmatch(name) is not None
        and "--" not in name
        and ".." not in name
        and not name.endswith(".git")
    )


@dataclass(frozen=True)
class HubName:
    """A model named on the Hub: a repo, and in it a GGUF file by quant type or by path, or
    neither (the repo's folder)."""

    repo_id: str
    quant_type: str | None = None
    file: str | None = None


def hub_name(name: str) -> HubName | None:
    """`name` read as vLLM reads a model of the Hub, or None when it is none: vLLM's
    `OWNER/NAME:QUANT_TYPE` (a GGML type's name such as Q4_K, IQ4_XS or F16, one with a size
    suffix such as Q4_K_M, or one with a dash-separated prefix such as UD-Q4_K_XL), vLLM's
    `OWNER/NAME/PATH.gguf`, or a repo id."""
    repo_id, colon, quant_type = name.rpartition(":")
    if colon and "/" in repo_id and is_repo_id(repo_id):
        known = _is_quant_type(quant_type) or _is_quant_type(quant_type.rpartition("-")[2])
        if re.fullmatch(r"[A-Za-z0-9_+-]+", quant_type) is not None and known:
            return HubName(repo_id, quant_type=quant_type)
    owner, _, rest = name.partition("/")
    repo, _, file = rest.partition("/")
    in_repo = file.endswith(".gguf") and is_repo_id(f"{owner}/{repo}")
    if in_repo and not any(segment in ("", ".", "..") for segment in file.split("/")):
        return HubName(f"{owner}/{repo}", file=file)
    return HubName(name) if is_repo_id(name) else None


def _is_quant_type(name: str) -> bool:
    from gguf import GGMLQuantizationType  # numpy's import, paid only for a name with a colon

    bases = [name] + [name[: -len(s)] for s in _QUANT_SUFFIXES if name.endswith(s)]
    return any(base in GGMLQuantizationType.__members__ for base in bases)


def fetch_command(
    name: HubName,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    include: Sequence[str] = (),
) -> str:
    """The command that downloads Hub model `name` at `revision` to where it is looked for
    (quoted for a POSIX shell), only the files matching `include` when it names patterns."""
    command = f"hf download {name.repo_id}"
    if name.file is not None:
        command += f" {shlex.quote(name.file)}"
    if name.quant_type is not None:  # what vLLM's patterns match, wherever in the repo
        include = (f"*-{name.quant_type}.gguf", f"*-{name.quant_type}-*.gguf", *include)
    for pattern in include:  # one option a pattern: `hf` reads one value after each
        command += f" --include {shlex.quote(pattern)}"
    if revision is not None:
        command += f" --revision {shlex.quote(revision)}"
    if download_dir is not None:
        command += f" --cache-dir {shlex.quote(str(download_dir))}"
    return command


def cached_model(
    name: str, revision: str | None = None, download_dir: str | Path | None = None
) -> Path | None:
    """Where Hub model `name` (`hub_name`) lies in the cache: its repo's snapshot folder, or
    the GGUF file it names there; None when the cache has no such repo, a HubCacheError when
    it has the repo but not the revision or file asked for."""
    parsed = hub_name(name)
    if parsed is None:
        return None
    fetch = fetch_command(parsed, revision, download_dir)
    folder = snapshot(parsed.repo_id, revision, download_dir, fetch)
    if folder is None:
        return None
    if parsed.quant_type is None and parsed.file is None:
        if not (folder / "config.json").exists() and any(folder.rglob("*.gguf")):
            raise GGUFNotNamed(name, folder)
        return folder
    chosen = parsed.file or gguf_in_snapshot(folder, parsed.quant_type or "")
    if chosen is None or not (folder / chosen).is_file():
        raise GGUFNotCached(name, folder, fetch)
    if _SPLIT_PART.search(chosen):
        raise SplitGGUF(name, chosen)
    return folder / chosen


def pinned_revision(
    name: str, revision: str | None, download_dir: str | Path | None = None
) -> str | None:
    """The commit that Hub model `name`'s `revision` names in the cache now (processes that
    load it later then read one snapshot even if a branch moves meanwhile); `revision` as
    given for a local path or a name the cache does not hold (its loading says why)."""
    parsed = hub_name(name)
    if parsed is None or Path(name).exists():
        return revision
    try:
        folder = snapshot(parsed.repo_id, revision, download_dir)
    except ValueError:
        return revision
    return revision if folder is None else folder.name


def gguf_in_snapshot(folder: Path, quant_type: str) -> str | None:
    """The GGUF file of `quant_type` in snapshot `folder` (its path there), as vLLM's
    `download_gguf` picks it: by glob, a name ending in `-QUANT_TYPE.gguf` or holding
    `-QUANT_TYPE-`, at the top or one folder down (no hidden files), the one with fewest dashes
    first (a whole file before split parts), then by name; None when there is none."""
    patterns = [f"*-{quant_type}.gguf", f"*-{quant_type}-*.gguf"]
    patterns += [f"*/{pattern}" for pattern in patterns]
    found = {file for pattern in patterns for file in glob.glob(pattern, root_dir=folder)}
    return min(found, key=lambda file: (file.count("-"), file), default=None)


def snapshot(
    repo_id: str,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    fetch: str | None = None,
) -> Path | None:
    """The folder of `repo_id` at `revision` (None: main) in the cache, or None when the cache
    holds no such repo; raise RevisionNotCached (naming `fetch`, the command that would
    download it) when it holds the repo but not that revision."""
    if not is_repo_id(repo_id):
        return None
    repo = hub_cache(download_dir) / ("models--" + repo_id.replace("/", "--"))
    if not repo.is_dir():
        return None
    wanted = DEFAULT_REVISION if revision is None else revision
    if any(part in ("", ".", "..") for part in wanted.split("/")):
        raise ValueError(f"revision {revision!r} is not a branch, tag or commit hash")
    ref = repo / "refs" / wanted
    commit = wanted  # a commit hash, unless a ref of that name says which
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        if "/" in commit or commit in ("", ".", ".."):
            raise HubCacheError(f"{ref} holds {commit!r}, not a commit hash")
    folder = repo / "snapshots" / commit
    if not folder.is_dir():
        fetch = fetch or fetch_command(HubName(repo_id), revision, download_dir)
        raise RevisionNotCached(repo_id, wanted, repo, fetch)
    return folder


def snapshot_hint(path: Path, include: Sequence[str] = ()) -> str:
    """For a file missing from a cached snapshot (`CACHE/models--OWNER--NAME/snapshots/
    COMMIT/FILE`): a sentence naming the repo and commit and the command that fetches that
    file into that cache, since a download of some files only, or one cut short, leaves a
    snapshot without the rest; "" for any other path. The innermost snapshot in the path is
    the one read. Where the file is one of several a repo may hold instead (the weights: one
    file, or shards and their index), `include` names patterns that match each of them."""
    parts = Path(path).parts
    for at in reversed(range(len(parts) - 3)):
        folder, snapshots, commit = parts[at : at + 3]
        repo_id = folder.removeprefix("models--").replace("--", "/")
        if folder.startswith("models--") and snapshots == "snapshots" and is_repo_id(repo_id):
            cache, file = Path(*parts[:at]), "/".join(parts[at + 3 :])
            download_dir = None if cache.resolve() == hub_cache().resolve() else cache
            name = HubName(repo_id, file=None if include else file)
            fetch = fetch_command(name, commit, download_dir, include)
            advice = "fetch them with" if include else "if the repo has it, fetch it with"
            return (
                f"; it is in the Hugging Face cache's snapshot of {repo_id!r} at commit "
                f"{commit}, which does not hold it: pagedkv downloads nothing; {advice} "
                f"`{fetch}`"
            )
    return ""


class HubCacheError(ValueError):
    """The cache holds the repo a name names, but not what the name asks of it."""


class RevisionNotCached(HubCacheError):
    """The cache holds a repo, but not the revision asked for."""

    def __init__(self, repo_id: str, revision: str, repo: Path, fetch: str) -> None:
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
            f"first, e.g. `{fetch}`"
        )


class GGUFNotCached(HubCacheError):
    """The cached snapshot of a repo holds no GGUF file of the quant type or path asked for."""

    def __init__(self, name: str, folder: Path, fetch: str) -> None:
        super().__init__(
            f"{name}: the Hugging Face cache's snapshot ({folder}) holds no such GGUF file "
            f"(its .gguf files: {_gguf_files(folder)}); pagedkv downloads nothing: fetch it "
            f"first, e.g. `{fetch}`"
        )


class GGUFNotNamed(HubCacheError):
    """A repo of GGUF files named alone: which file is not said."""

    def __init__(self, name: str, folder: Path) -> None:
        super().__init__(
            f"{name!r} in the Hugging Face cache ({folder}) holds GGUF files, not a model folder "
            f"({_gguf_files(folder)}): name one as vLLM does, {name}:QUANT_TYPE (e.g. Q4_K_M) "
            f"or {name}/FILE.gguf"
        )


def _gguf_files(folder: Path) -> str:
    """The .gguf files of a snapshot, for an error."""
    files = sorted(str(path.relative_to(folder)) for path in folder.rglob("*.gguf"))
    return ", ".join(files) or "none"


class SplitGGUF(HubCacheError):
    """The GGUF file a name picks is one part of a split model; pagedkv reads one file."""

    def __init__(self, name: str, part: str) -> None:
        super().__init__(
            f"{name} is split into parts ({part}, ...): pagedkv reads a GGUF model from one file "
            "(merge the parts with llama.cpp's `llama-gguf-split --merge`)"
        )
