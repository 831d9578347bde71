"""Models named by Hugging Face repo id, read from the local Hugging Face cache.

Oracles: huggingface_hub (transformers' dependency, imported by tests only) reads the same
cache: `try_to_load_from_cache` says which snapshot a repo id and revision name, and its
constants, read in a fresh interpreter under each environment, say where the cache lies. A
model loaded by repo id must answer bit for bit as its snapshot's folder loaded by path.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import filter_repo_objects, validate_repo_id
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from pagedkv.cli import main as cli_main
from pagedkv.commands.planning_model import resolve_planning_model
from pagedkv.engine import LLM, EngineArgs, SamplingParams
from pagedkv.hf_cache import (
    GGUFNotCached,
    GGUFNotNamed,
    HubCacheError,
    HubName,
    RevisionNotCached,
    SplitGGUF,
    cached_model,
    gguf_in_snapshot,
    hub_cache,
    hub_name,
    is_repo_id,
    snapshot,
    snapshot_hint,
)
from pagedkv.hub import UnknownModelName
from pagedkv.kvmath.errors import ConfigError
from pagedkv.model.errors import ModelError
from pagedkv.weights.hf_folder import INDEX_FILE, SINGLE_FILE
from pagedkv.weights.load import load_tokenizer
from tests.hub_cache import cache_repo, commit_of
from tests.model.tiny_models import copy_with_chat_template

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, prompt_logprobs=1)
PROMPTS = [[5, 9, 14, 3, 22], [7, 7, 31, 2]]
SMALL = dict(num_gpu_blocks=64, swap_space_gb=0.01)
HUB_VARIABLES = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache that every lookup reads ($HF_HUB_CACHE)."""
    for variable in HUB_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    cache = tmp_path / "hf-hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def answers(llm: LLM) -> list:
    """Every token id and logprob of greedy runs over PROMPTS, prompt logprobs too."""
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [
        (output.prompt_logprobs, [(s.token_ids, s.logprobs) for s in output.outputs])
        for output in outputs
    ]


REPO_IDS = st.from_regex(
    r"\A(?:[A-Za-z0-9_]{1,8}/)?[A-Za-z0-9]{1,6}(?:[.-][A-Za-z0-9]{1,4}){0,2}\Z"
)
BRANCHES = st.sampled_from(["main", "v1", "dev", "release/2"])


@settings(max_examples=60, deadline=None)
@given(
    repo_id=REPO_IDS,
    refs=st.dictionaries(BRANCHES, st.integers(0, 3), max_size=3),
    present=st.sets(st.integers(0, 3), max_size=4),
    asked=st.one_of(st.none(), BRANCHES, st.integers(0, 4).map(lambda i: commit_of(str(i)))),
)
def test_a_repo_id_names_the_snapshot_huggingface_hub_would_read(
    tmp_path_factory, repo_id, refs, present, asked
) -> None:
    """Over random refs, cached commits and revisions (a branch, a commit, none), the folder
    pagedkv reads is the one huggingface_hub finds config.json in; where it finds none, pagedkv
    says the repo is missing (None) or names the revision it lacks."""
    cache = tmp_path_factory.mktemp("hub")
    source = cache / "source"
    source.mkdir()
    (source / "config.json").write_text("{}")
    if present or refs:
        cache_repo(
            cache,
            repo_id,
            {commit_of(str(i)): source for i in present},
            {name: commit_of(str(i)) for name, i in refs.items()},
        )
    expected = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache, revision=asked)
    if isinstance(expected, str):
        assert snapshot(repo_id, asked, cache) == Path(expected).parent
    elif not (present or refs):
        assert snapshot(repo_id, asked, cache) is None
    else:
        with pytest.raises(RevisionNotCached, match=f"without revision '{asked or 'main'}'"):
            snapshot(repo_id, asked, cache)


def test_the_cache_lies_where_huggingface_hub_puts_it(tmp_path: Path) -> None:
    """Under each environment, huggingface_hub's own constants (read fresh in another
    interpreter) name the folder pagedkv reads."""
    environments = [
        {},
        {"XDG_CACHE_HOME": str(tmp_path / "xdg")},
        {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "HF_HOME": str(tmp_path / "home")},
        {"HF_HOME": str(tmp_path / "home"), "HUGGINGFACE_HUB_CACHE": str(tmp_path / "legacy")},
        {"HUGGINGFACE_HUB_CACHE": str(tmp_path / "legacy"), "HF_HUB_CACHE": str(tmp_path / "h")},
        {"HF_HUB_CACHE": "~/hub-in-home"},
        {"HF_HOME": "~/h"},
        {"XDG_CACHE_HOME": "$HOME/x"},
        {"HF_HUB_CACHE": ""},
    ]
    script = "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)"
    base = {k: v for k, v in os.environ.items() if k not in HUB_VARIABLES}
    base["HOME"] = str(tmp_path / "user")
    for extra in environments:
        environment = base | extra
        result = subprocess.run(
            [sys.executable, "-c", script], env=environment, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        expected = Path(result.stdout.strip())
        code = "from pagedkv.hf_cache import hub_cache; print(hub_cache())"
        ours = subprocess.run(
            [sys.executable, "-c", code], env=environment, capture_output=True, text=True
        )
        assert Path(ours.stdout.strip()) == expected, (extra, ours.stderr)
    assert hub_cache(tmp_path / "dl") == tmp_path / "dl"  # vLLM's download_dir comes first


def test_a_model_by_repo_id_answers_as_its_folder(zoo, hub: Path) -> None:
    """main, a branch and a commit each load their own snapshot; the outputs are bit for bit
    those of the folder loaded by path, and the model keeps the repo id as its name."""
    llama, qwen = zoo.folder("llama"), zoo.folder("qwen2")
    old, new = commit_of("old"), commit_of("new")
    cache_repo(hub, "tiny-org/tiny-model", {old: llama, new: qwen}, {"main": old, "v2": new})
    by_id = LLM("tiny-org/tiny-model", **SMALL)
    assert by_id.engine.model_name == "tiny-org/tiny-model"
    assert answers(by_id) == answers(LLM(str(llama), **SMALL))
    by_branch = answers(LLM("tiny-org/tiny-model", revision="v2", **SMALL))
    assert by_branch == answers(LLM(str(qwen), **SMALL)) != answers(by_id)
    assert answers(LLM("tiny-org/tiny-model", revision=new, **SMALL)) == by_branch


def test_download_dir_is_the_cache_a_repo_id_is_read_from(zoo, hub: Path, tmp_path) -> None:
    """vLLM downloads into download_dir: a repo there is found, and the default cache is not
    read instead."""
    elsewhere = tmp_path / "downloads"
    cache_repo(elsewhere, "org/m", {commit_of("a"): zoo.folder("llama")}, {"main": commit_of("a")})
    llm = LLM("org/m", download_dir=str(elsewhere), **SMALL)
    assert answers(llm) == answers(LLM(str(zoo.folder("llama")), **SMALL))
    with pytest.raises(UnknownModelName, match=str(hub)):
        LLM("org/m", **SMALL)
    with pytest.raises(UnknownModelName) as absent:  # the advice fills the folder looked in
        LLM("org/absent", download_dir=str(elsewhere), revision="v2", **SMALL)
    assert f"`hf download org/absent --revision v2 --cache-dir {elsewhere}`" in str(absent.value)


def test_what_the_cache_lacks_is_named(zoo, hub: Path, tmp_path, monkeypatch) -> None:
    with pytest.raises(UnknownModelName) as missing:
        LLM("nobody/absent-model", **SMALL)
    message = str(missing.value)
    assert f"Hugging Face cache ({hub};" in message
    assert "pagedkv downloads nothing" in message and "`hf download nobody/absent-model`" in message
    cache_repo(hub, "org/m", {commit_of("a"): zoo.folder("llama")}, {"main": commit_of("a")})
    with pytest.raises(RevisionNotCached, match=r"without revision 'v9' .*held: main\)"):
        LLM("org/m", revision="v9", **SMALL)
    with pytest.raises(ValueError, match=r"revision 'v1': .* is a local path, which has no"):
        LLM(str(zoo.folder("llama")), revision="v1", **SMALL)
    with pytest.raises(ValueError, match=r"^tokenizer_revision 't1': .* is a local path"):
        LLM(str(zoo.folder("llama")), tokenizer_revision="t1", **SMALL)
    for revision in (".", "./", "main/.", "a/../b", "/etc", ""):
        with pytest.raises(ValueError, match="is not a branch, tag or commit hash"):
            snapshot("org/m", revision)
    (hub / "models--org--m" / "refs" / "escape").write_text("../../outside")
    with pytest.raises(HubCacheError, match="not a commit hash"):
        snapshot("org/m", "escape")
    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path / "empty"))  # refused before any pull
    with pytest.raises(ValueError, match=r"is a built-in model, which has no revisions"):
        LLM("smollm2-135m-instruct", revision="v1", **SMALL)
    assert not (tmp_path / "empty").exists()
    not_an_id = tmp_path / "no" / "such" / "folder"
    with pytest.raises(UnknownModelName) as path_error:
        LLM(str(not_an_id), **SMALL)
    assert "Hugging Face" not in str(path_error.value)  # a path is not looked up as a repo


def test_a_snapshot_missing_files_says_how_to_fetch_them(zoo, hub: Path, tmp_path) -> None:
    """A download cut short leaves a snapshot without some of its files: each missing file
    (config, weights, a shard, the tokenizer) is named with the command that fetches the
    snapshot's commit into the cache it was read from; huggingface_hub agrees it is absent."""
    commit = commit_of("partial")
    folder = tmp_path / "sharded"
    shutil.copytree(zoo.folder("llama"), folder)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    with safe_open(folder / "model-00001-of-00001.safetensors", framework="pt") as shard:
        weight_map = dict.fromkeys(shard.keys(), "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for cache, dir_option in ((hub, ""), (tmp_path / "down loads", " --cache-dir")):
        download_dir = None if cache == hub else str(cache)
        for lost in ("config.json", "model-00001-of-00001.safetensors", "tokenizer.json"):
            fetch = f"`hf download org/m {lost} --revision {commit}"
            fetch += f"{dir_option} '{cache}'`" if dir_option else "`"  # quoted: a space
            repo = cache_repo(cache, "org/m", {commit: folder}, {"main": commit})
            (repo / "snapshots" / commit / lost).unlink()
            assert try_to_load_from_cache("org/m", lost, cache_dir=cache) is None
            with pytest.raises(ModelError, match="missing") as error:
                LLM("org/m", download_dir=download_dir, **SMALL)
            message = str(error.value)
            assert lost in message and f"'org/m' at commit {commit}" in message
            assert message.endswith(fetch), message
            shutil.rmtree(repo)
    with pytest.raises(ModelError, match="missing") as by_path:  # not a snapshot: no advice
        LLM(str(tmp_path / "down loads"), **SMALL)
    assert "hf download" not in str(by_path.value)
    inner = f"{hub}/models--a--b/snapshots/{commit}/models--c--d/snapshots/{commit}/x/y.json"
    assert f"of 'c/d' at commit {commit}" in snapshot_hint(Path(inner))
    inner_cache = f"{hub}/models--a--b/snapshots/{commit}"
    assert snapshot_hint(Path(inner)).endswith(
        f"`hf download c/d x/y.json --revision {commit} --cache-dir {inner_cache}`"
    )


@pytest.mark.parametrize("sharded", [False, True])
def test_a_snapshot_without_weights_is_told_the_patterns_of_either_layout(
    zoo, hub: Path, tmp_path, sharded
) -> None:
    """A snapshot holding neither the one weights file nor the shard index (a download of the
    config only) is told to fetch both layouts' files; huggingface_hub's own pattern filter,
    which `hf download --include` applies, picks exactly the repo's weight files from them."""
    commit = commit_of("weightless")
    folder = tmp_path / "repo"
    shutil.copytree(zoo.folder("llama"), folder)
    if sharded:
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        with safe_open(folder / "model-00001-of-00001.safetensors", framework="pt") as shard:
            weight_map = dict.fromkeys(shard.keys(), "model-00001-of-00001.safetensors")
        (folder / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(folder / "config.json", folder / "consolidated.safetensors")  # another copy
    weights = {"model-00001-of-00001.safetensors", INDEX_FILE} if sharded else {SINGLE_FILE}
    files = sorted(path.name for path in folder.iterdir())
    repo = cache_repo(hub, "org/m", {commit: folder}, {"main": commit})
    for name in weights:
        (repo / "snapshots" / commit / name).unlink()
    with pytest.raises(ModelError, match="no weights: .* fetch them with `hf download") as error:
        LLM("org/m", **SMALL)
    asked = hf_download(str(error.value).split("`")[-2])
    assert (asked["repo_id"], asked["revision"], asked["filenames"]) == ("org/m", commit, ())
    assert set(filter_repo_objects(files, allow_patterns=asked["include"])) == weights


def hf_download(command: str) -> dict:
    """What huggingface_hub's own `hf download` parser reads from `command` (nothing is run)."""
    import typer
    from huggingface_hub.cli.download import download

    app = typer.Typer()
    app.command()(download)
    program, verb, *args = shlex.split(command)
    assert (program, verb) == ("hf", "download"), command
    return typer.main.get_command(app).make_context(verb, args).params


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="aBé_.-/ 9:", max_size=12) | st.from_regex(r"\A[a-z.-]{1,97}\Z"))
def test_a_repo_id_is_what_huggingface_hub_accepts(name: str) -> None:
    """Spelled as a repo id exactly when huggingface_hub's validator takes it (so a path such
    as `./m` or `a/b/c` is never looked up in the cache)."""
    try:
        validate_repo_id(name)
        valid = True
    except HFValidationError:
        valid = False
    assert is_repo_id(name) == valid


def test_the_tokenizers_revision_follows_vllm(zoo, hub: Path, tmp_path) -> None:
    """vLLM's rule: a tokenizer named by repo id is read at tokenizer_revision, else at the
    model's revision; a local one takes no revision but inherits none either. Told apart by
    the chat template each revision's files carry."""
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    styled = copy_with_chat_template(zoo.folder("llama"), tmp_path / "styled", template)
    plain_commit, styled_commit = commit_of("plain"), commit_of("styled")
    refs = {"main": plain_commit, "v2": styled_commit}
    cache_repo(hub, "org/t", {plain_commit: zoo.folder("llama"), styled_commit: styled}, refs)

    def template_of(source: str, **revisions) -> str | None:
        return load_tokenizer(source, 10_000, **revisions).chat_template

    plain = template_of(str(zoo.folder("llama")))
    assert plain != template
    assert template_of("org/t", model_revision="v2") == template  # inherited
    assert template_of("org/t", revision="main", model_revision="v2") == plain  # its own first
    assert template_of("org/t") == plain
    assert template_of(str(styled), model_revision="v2") == template  # a path inherits none
    assert EngineArgs(model="org/m", revision="v2").separate_tokenizer is None
    assert EngineArgs(model="org/m", tokenizer_revision="t1").separate_tokenizer == "org/m"


def test_a_tokenizer_and_a_draft_model_by_repo_id(zoo, hub: Path, tmp_path) -> None:
    """`tokenizer=` reads the cached revision's files (its own chat template); a draft model
    named by repo id and revision drafts, and greedy answers are unchanged (exactness)."""
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    retemplated = copy_with_chat_template(zoo.folder("llama"), tmp_path / "styled", template)
    plain, styled = commit_of("plain"), commit_of("styled")
    cache_repo(hub, "org/m", {plain: zoo.folder("llama"), styled: retemplated}, {"main": plain})
    model = str(zoo.folder("llama"))
    llm = LLM(model, tokenizer="org/m", tokenizer_revision=styled, **SMALL)
    assert llm.get_tokenizer().chat_template == template
    speculative = {"model": "org/m", "revision": styled, "num_speculative_tokens": 2}
    drafted = LLM(model, speculative_config=speculative, **SMALL)
    assert answers(drafted) == answers(LLM(model, **SMALL))
    assert drafted.engine.scheduler.drafts.stats.num_accepted_tokens > 0
    with pytest.raises(ValueError, match="^speculative_config model: .* without revision 'v7'"):
        LLM(model, speculative_config=speculative | {"revision": "v7"}, **SMALL)


def test_plan_sizes_a_repo_id_as_its_snapshot(zoo, hub: Path) -> None:
    commit = commit_of("a")
    cache_repo(hub, "org/m", {commit: zoo.folder("qwen2")}, {"main": commit})
    by_id = resolve_planning_model("org/m")
    by_path = resolve_planning_model(str(hub / "models--org--m" / "snapshots" / commit))
    assert by_id == replace(by_path, name="org/m")
    assert by_id.spec == resolve_planning_model(str(zoo.folder("qwen2"))).spec
    cache_repo(hub, "org/broken", {}, {"v1": commit})
    with pytest.raises(ConfigError, match="without revision 'main'"):
        resolve_planning_model("org/broken")
    with pytest.raises(ConfigError, match=r"nor a repo in the Hugging Face cache .*hf download"):
        resolve_planning_model("org/absent")
    branch = commit_of("branch")  # --revision and --download-dir pick the engine's snapshot
    elsewhere = hub.parent / "elsewhere"
    cache_repo(elsewhere, "org/m", {commit: zoo.folder("qwen2"), branch: zoo.folder("llama")}, {})
    llama = resolve_planning_model(str(zoo.folder("llama"))).spec
    assert resolve_planning_model("org/m", None, branch, str(elsewhere)).spec == llama
    with pytest.raises(ConfigError, match=r"--revision 'v1': .* has no revisions"):
        resolve_planning_model("llama-3-8b", None, "v1")
    args = ["plan", "--model", "org/m", "--pool-gb", "1", "--download-dir", str(elsewhere)]
    assert cli_main([*args, "--revision", branch]) == 0
    assert cli_main([*args, "--revision", "v9"]) == 2  # named: not in that cache
    config = elsewhere / "models--org--m" / "snapshots" / branch / "config.json"
    config.unlink()
    with pytest.raises(
        ConfigError, match=r"config.json: no such config file; .* at commit"
    ) as lost:
        resolve_planning_model("org/m", None, branch, str(elsewhere))
    assert str(lost.value).endswith(
        f"`hf download org/m config.json --revision {branch} --cache-dir {elsewhere}`"
    )
    config.write_text("{not json")  # there but unreadable: fetching it again cannot help
    with pytest.raises(ConfigError, match="not valid JSON") as malformed:
        resolve_planning_model("org/m", None, branch, str(elsewhere))
    assert "hf download" not in str(malformed.value)


def test_hub_names_are_read_as_vllm_reads_them() -> None:
    """vLLM's GGUF spellings (REPO:QUANT_TYPE with a GGML type, a size suffix or a dashed
    prefix; REPO/PATH.gguf) and plain repo ids; anything else is no Hub name."""
    assert hub_name("unsloth/Qwen3-0.6B-GGUF:Q4_K_M") == HubName(
        "unsloth/Qwen3-0.6B-GGUF", quant_type="Q4_K_M"
    )
    for quant_type in ("Q4_K", "F16", "IQ4_XS", "Q3_K_XL", "UD-Q4_K_XL", "Custom-Q8_0"):
        assert hub_name(f"org/m-GGUF:{quant_type}") == HubName("org/m-GGUF", quant_type=quant_type)
    for file in ("m-Q8_0.gguf", "sub/m-00001-of-00002.gguf"):
        assert hub_name(f"org/m-GGUF/{file}") == HubName("org/m-GGUF", file=file)
    assert hub_name("org/m") == HubName("org/m") and hub_name("gpt2") == HubName("gpt2")
    not_hub = ("org/m:q4_k_m", "org/m:Q9_K", "org/m:", "gpt2:Q4_K", "./m:Q4_K", "org/m/x.bin")
    for name in (*not_hub, "org/m/../x.gguf", "org/m//x.gguf", "/abs/m.gguf", "a/b/c"):
        assert hub_name(name) is None, name


GGUF_FILES = st.lists(
    st.builds(
        "{}{}-{}{}.gguf".format,
        st.sampled_from(["", "sub/", "a/b/", ".hidden/"]),
        st.sampled_from(["Tiny", "Tiny-1B", "tiny", ".dot"]),
        st.sampled_from(["Q4_K_M", "Q4_K_S", "Q8_0", "q8_0", "F16", "UD-Q4_K_M"]),
        st.sampled_from(["", "-00001-of-00002", "-imatrix"]),
    ),
    unique=True,
    max_size=8,
)


@settings(max_examples=150, deadline=None)
@given(files=GGUF_FILES, quant_type=st.sampled_from(["Q4_K_M", "Q8_0", "F16"]))
def test_the_gguf_file_is_the_one_vllm_picks(tmp_path_factory, files, quant_type) -> None:
    """Over random repo listings (subfolders, hidden files, split parts), the file is the one
    vLLM's `download_gguf` picks: its four patterns globbed in the snapshot, fewest dashes
    first, then by name. Through the cache, a pick that is a split part is refused by name,
    and no pick names the quant type and the files there are."""
    cache = tmp_path_factory.mktemp("hub")
    source = cache / "source"
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(b"GGUF")
    commit = commit_of("files")
    cache_repo(cache, "org/m-GGUF", {commit: source}, {"main": commit})
    folder = cache / "models--org--m-GGUF" / "snapshots" / commit
    folder.mkdir(parents=True, exist_ok=True)  # a snapshot with no files at all, too
    patterns = [f"*-{quant_type}.gguf", f"*-{quant_type}-*.gguf"]
    patterns += [f"*/*-{quant_type}.gguf", f"*/*-{quant_type}-*.gguf"]
    globbed = {path for p in patterns for path in glob.glob(os.path.join(folder, p))}
    vllm_pick = sorted(globbed, key=lambda path: (path.count("-"), path))
    expected = os.path.relpath(vllm_pick[0], folder) if vllm_pick else None
    assert gguf_in_snapshot(folder, quant_type) == expected
    name = f"org/m-GGUF:{quant_type}"
    if expected is None:
        with pytest.raises(GGUFNotCached, match="holds no such GGUF file"):
            cached_model(name, download_dir=cache)
    elif "-of-0000" in expected:
        with pytest.raises(SplitGGUF, match=r"is split into parts .*llama-gguf-split --merge"):
            cached_model(name, download_dir=cache)
    else:
        assert cached_model(name, download_dir=cache) == folder / expected


def test_a_gguf_file_by_repo_and_quant_type_answers_as_the_file(zoo, tiny_gguf, hub) -> None:
    """`REPO:QUANT_TYPE` loads that file of the cached repo: bit for bit the file's answers,
    the name kept; plan sizes the same file; a quant type the repo lacks is named."""
    q8, f32 = tiny_gguf("llama", qtype=GGMLQuantizationType.Q8_0), tiny_gguf("qwen2")
    repo = hub.parent / "gguf-repo"
    repo.mkdir()
    shutil.copy(q8, repo / "Tiny-Q8_0.gguf")
    shutil.copy(f32, repo / "Tiny-F32.gguf")
    commit = commit_of("gguf")
    cache_repo(hub, "org/Tiny-GGUF", {commit: repo}, {"main": commit})
    llm = LLM("org/Tiny-GGUF:Q8_0", **SMALL)
    assert llm.engine.model_name == "org/Tiny-GGUF:Q8_0"
    assert answers(llm) == answers(LLM(str(q8), **SMALL))
    assert answers(LLM("org/Tiny-GGUF:F32", **SMALL)) == answers(LLM(str(f32), **SMALL))
    planned = resolve_planning_model("org/Tiny-GGUF:F32")
    assert planned.name == "org/Tiny-GGUF:F32"
    assert planned.spec == resolve_planning_model(str(f32)).spec
    with pytest.raises(GGUFNotCached, match=r":Q4_K_M: .* holds no such GGUF file"):
        LLM("org/Tiny-GGUF:Q4_K_M", **SMALL)
    with pytest.raises(UnknownModelName, match="fetch it first, e.g. `hf download") as error:
        LLM("org/Other-GGUF:Q8_0", **SMALL)
    asked = hf_download(str(error.value).split("`")[-2])
    assert (asked["repo_id"], asked["include"]) == (
        "org/Other-GGUF",
        ["*-Q8_0.gguf", "*-Q8_0-*.gguf"],
    )
    by_file = LLM("org/Tiny-GGUF/Tiny-Q8_0.gguf", **SMALL)  # vLLM's REPO/FILE.gguf
    assert answers(by_file) == answers(LLM(str(q8), **SMALL))
    with pytest.raises(GGUFNotCached, match=r"holds no such GGUF file \(its .gguf files: Tiny-F32"):
        LLM("org/Tiny-GGUF/Tiny-Q4_0.gguf", **SMALL)
    with pytest.raises(GGUFNotNamed, match=r"name one as vLLM does, org/Tiny-GGUF:QUANT_TYPE"):
        LLM("org/Tiny-GGUF", **SMALL)
    by_name, by_path = hub.parent / "by-name", hub.parent / "by-path"  # `pagedkv convert`, too
    assert cli_main(["convert", "org/Tiny-GGUF:Q8_0", str(by_name)]) == 0
    assert cli_main(["convert", str(q8), str(by_path)]) == 0
    for file in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (by_name / file).read_bytes() == (by_path / file).read_bytes(), file


def test_every_rank_is_sent_the_commit_the_revision_names_at_start(zoo, hub: Path) -> None:
    """What tensor-parallel ranks load (`load_spec`) names the commit a branch pointed at when
    the engine started, so a branch moved while ranks start (a concurrent `hf download`)
    cannot give them different weights; and loading that commit is loading the branch."""
    old, new = commit_of("old"), commit_of("new")
    snapshots = {old: zoo.folder("llama"), new: zoo.folder("qwen2")}
    repo = cache_repo(hub, "org/m", snapshots, {"main": old})
    spec = EngineArgs(model="org/m", **SMALL).load_spec()
    assert spec.revision == old
    (repo / "refs" / "main").write_text(new)  # the branch moves after the start
    pinned = LLM("org/m", revision=spec.revision, **SMALL)
    assert answers(pinned) == answers(LLM(str(zoo.folder("llama")), **SMALL))
    assert EngineArgs(model="org/m", revision="main", **SMALL).load_spec().revision == new
    for model, revision in ((str(zoo.folder("llama")), None), ("org/absent", "v1")):
        assert EngineArgs(model=model, revision=revision).load_spec().revision == revision
