"""The `pagedkv` command line: one subcommand per module in `pagedkv.commands`.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`. Modules are
imported only when their command runs, so `pagedkv plan` never pays for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import version
from typing import Any, NoReturn

from pagedkv.engine.args_help import human_readable_int

COMMANDS: dict[str, str] = {
    "demo": "serve chat requests through the engine with a live KV pool view (--memory: "
    "the memory walk-through)",
    "plan": "KV-cache capacity per token, per request and per GPU for a model",
    "simulate": "simulate serving a workload under slab and paged KV allocation",
    "generate": "generate a completion for one prompt, streamed to the terminal",
    "chat": "chat with a model in the terminal, reusing each turn's KV through the prefix cache",
    "bench": "measure engine throughput against transformers on one workload",
    "serve": "serve a model over an OpenAI-compatible HTTP API with a live KV page map",
    "pull": "download a built-in model into the local cache",
    "convert": "convert a GGUF file into a Hugging Face folder",
    "perplexity": "a model's perplexity on a text file (llama.cpp's method)",
    "worker": "serve as one tensor-parallel rank of an engine on another machine (torchrun's "
    "environment)",
}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen subcommand."""
    argv = vllm_spellings(sys.argv[1:] if argv is None else argv)
    # No abbreviated flags: with ~40 engine flags a prefix such as --n is ambiguous or, worse,
    # silently means another flag.
    parser = argparse.ArgumentParser(
        prog="pagedkv", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument(  # vLLM's `vllm --version`
        "--version", action="version", version=f"pagedkv {version('pagedkv')}"
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    commands = {}
    for name, help_text in COMMANDS.items():
        commands[name] = subparsers.add_parser(
            name, help=help_text, description=help_text, allow_abbrev=False
        )
        if name == chosen:
            _command_module(name).add_arguments(commands[name])
            commands[name].add_argument(
                "--config",
                metavar="FILE",
                help="read options from a YAML file, as vLLM's --config: a mapping of option "
                "names (dashes or underscores) to values; the command line wins over it",
            )
            argv = with_config(argv, commands[name])
    argv = dotted_json(argv, commands[chosen].error if chosen else parser.error)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command's own usage, not the top level's
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return _command_module(args.command).run(args)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 1


# vLLM's short options, as its command line takes them.
SHORT_OPTIONS = {
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-dp": "--data-parallel-size",
    "-q": "--quantization",
}


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's parser for scripts (`from vllm.utils import FlexibleArgumentParser`, then
    `EngineArgs.add_cli_args(parser)`): it reads a script's command line as `pagedkv` commands
    read theirs, vLLM's other spellings (`vllm_spellings`) and `--config FILE`
    (`with_config`) included, and takes no prefix of an option for the option."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]  # argparse's overloads, one behaviour
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = vllm_spellings(list(sys.argv[1:] if args is None else args))
        argv = dotted_json(with_config([self.prog, *argv], self)[1:], self.error)
        return super().parse_known_args(argv, namespace)


def vllm_spellings(argv: list[str]) -> list[str]:
    """The command line with vLLM's other spellings made ours, as vLLM's own parser reads
    them: `--max_num_seqs` is `--max-num-seqs` (the option's name only, up to a dotted key's
    first ".", never its value), and `-tp`, `-pp`, `-dp` and `-q` are
    `--tensor-parallel-size`, `--pipeline-parallel-size`, `--data-parallel-size` and
    `--quantization`."""
    spelled = []
    for arg in argv:
        name, equals, value = arg.partition("=")
        if name in SHORT_OPTIONS:
            name = SHORT_OPTIONS[name]
        elif name.startswith("--") and len(name) > 2:
            option, dot, keys = name[2:].partition(".")
            name = "--" + option.replace("_", "-") + dot + keys
        spelled.append(name + equals + value)
    return spelled


def dotted_json(argv: list[str], error: Callable[[str], NoReturn]) -> list[str]:
    """vLLM's dotted form of a JSON option: `--speculative-config.method ngram
    --speculative-config.num_speculative_tokens 4` is `--speculative-config
    '{"method": "ngram", "num_speculative_tokens": 4}'`; `--OPT.a.b V` nests (`{"a": {"b":
    V}}`), `--OPT.k+ V` appends to a list (`V` split at commas). A value is read as JSON, else
    as a count (vLLM's `2k`, `1_000`), else as text. Each option's keys are gathered into one
    JSON object, given where each of its dotted tokens was (so a positional argument after
    them stays one) and once more after the other options (before a typed "--"), so it
    replaces a whole JSON value given for the same option, as in vLLM. A key given twice keeps
    its last value, with vLLM's warning naming it."""
    end = argv.index("--") if "--" in argv else len(argv)
    objects: dict[str, dict[str, Any]] = {}
    duplicates: list[str] = []
    placed: list[str | tuple[str]] = []  # arguments, or (option,) where its object goes
    at = 0
    while at < end:
        arg = argv[at]
        name, equals, text = arg.partition("=")
        option, dot, path = name.partition(".")
        if not (name.startswith("--") and dot and _DOTTED_KEYS.fullmatch(path)):
            placed.append(arg)
            at += 1
            continue
        if not equals:
            if at + 1 >= end:
                error(f"argument {name}: expected one argument")
            text, at = argv[at + 1], at + 1
        at += 1
        value = json.dumps(text.split(",")) if path.endswith("+") else text
        nested: Any = _dotted_value(value)
        for key in reversed(path.removesuffix("+").split(".")):
            nested = {key: nested}
        duplicates += [f"{option}.{key}" for key in _merge(objects.setdefault(option, {}), nested)]
        placed.append((option,))
    if duplicates:  # each key once, as vLLM's set of them
        print(
            f"warning: found duplicate keys {', '.join(dict.fromkeys(duplicates))}", file=sys.stderr
        )
    spelled = {option: f"{option}={json.dumps(value)}" for option, value in objects.items()}
    kept = [spelled[arg[0]] if isinstance(arg, tuple) else arg for arg in placed]
    return [*kept, *spelled.values(), *argv[end:]]


# The keys after an option's name in vLLM's dotted form: non-empty names joined by ".", and
# a "+" at the end to append.
_DOTTED_KEYS = re.compile(r"[^.+]+(?:\.[^.+]+)*\+?")


def _dotted_value(text: str) -> Any:
    """A dotted option's value as vLLM reads it: JSON, else a count (with a suffix, or as
    Python's int() reads it: `1_000`, `+5`), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return human_readable_int(text)
    except argparse.ArgumentTypeError:
        pass
    try:
        return int(text)
    except ValueError:
        return text


def _merge(into: dict[str, Any], update: dict[str, Any]) -> list[str]:
    """`update` into `into`, as vLLM merges dotted keys: objects merge key by key, lists
    concatenate, anything else replaces. Returns the dotted paths of the values replaced."""
    replaced = []
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            replaced += [f"{key}.{path}" for path in _merge(into[key], value)]
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key] += value
        else:
            if key in into:
                replaced.append(key)
            into[key] = value
    return replaced


def with_config(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` (the command first) with its `--config FILE` replaced by the file's options, as
    vLLM's parser reads a config: `key: value` is `--key=value`; true a flag given, false
    `--no-key` where there is one (else the flag left out); a list the values of an option
    that takes several (repeats of a repeatable one), a list or mapping the JSON of one that
    takes one value (`speculative_config`, `allowed_origins`); null or an empty list leaves
    the option out. An option also typed on the command line, under the same name, keeps the
    typed value. vLLM's dotted key of a JSON option (`speculative_config.method: ngram`) is its
    dotted flag (`dotted_json`), put first so that typed keys of the same option win."""
    command, rest = argv[0], argv[1:]
    names = [arg.partition("=")[0] for arg in rest]
    if "--config" not in names or "-h" in names or "--help" in names:  # help reads no file
        return argv
    if names.count("--config") > 1:
        parser.error("--config is given more than once")
    at = names.index("--config")
    if "=" in rest[at]:
        path, rest = rest[at].partition("=")[2], rest[:at] + rest[at + 1 :]
    elif at + 1 < len(rest):
        path, rest = rest[at + 1], rest[:at] + rest[at + 2 :]
    else:
        parser.error("argument --config: expected one argument")
    options = parser._option_string_actions  # argparse's own table of option strings
    given = {
        options[arg.partition("=")[0]].dest for arg in rest if arg.partition("=")[0] in options
    }
    added: list[str] = []
    dotted: list[str] = []  # vLLM's dotted keys of JSON options, typed ones merged over them
    keys_of: dict[str, object] = {}  # each option's key in the file, by destination
    for key, value in _read_config(path, parser).items():
        if "." in str(key) and value is not None:
            [flag] = vllm_spellings([f"--{key}={_config_text(value)}"])
            if flag.partition(".")[0] not in options:
                parser.error(f"--config {path}: {key!r} is not an option of this command")
            dotted.append(flag)
            continue
        name = "--" + str(key).replace("_", "-")
        negated = "--no-" + name[2:]
        action = options.get(name) or (options.get(negated) if value is False else None)
        if action is None or name == "--config":
            parser.error(f"--config {path}: {key!r} is not an option of this command")
        if action.dest in keys_of:  # two names of one option (an alias, a --no- form)
            parser.error(f"--config {path}: {keys_of[action.dest]!r} and {key!r} set one option")
        keys_of[action.dest] = key
        if action.dest in given or value is None or value == []:
            continue
        negation = negated if negated in options else None
        added += _config_tokens(action, name, negation, value, path, parser)
    end = rest.index("--") if "--" in rest else len(rest)  # options before a typed "--"
    return [command, *dotted, *rest[:end], *vllm_spellings(added), *rest[end:]]


def _config_tokens(
    action: argparse.Action,
    name: str,
    negation: str | None,
    value: object,
    path: str,
    parser: argparse.ArgumentParser,
) -> list[str]:
    """The command-line tokens of one config entry (`with_config`)."""
    if action.nargs == 0:  # a flag
        if not isinstance(value, bool):
            parser.error(f"--config {path}: {name[2:]!r} is a flag: give true or false")
        return [name] if value else ([negation] if negation else [])
    items = value if isinstance(value, list) else [value]
    if isinstance(action, argparse._AppendAction):
        return [f"{name}={_config_text(item)}" for item in items]  # repeated
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        return [name, *map(_config_text, items)]
    return [f"{name}={_config_text(value)}"]  # one value, even one that starts with "-"


def _config_text(item: object) -> str:
    """A config value as typed: JSON for a list or mapping, true/false for a boolean."""
    if isinstance(item, dict | list):
        return json.dumps(item)
    return str(item).lower() if isinstance(item, bool) else str(item)


def _read_config(path: str, parser: argparse.ArgumentParser) -> dict:
    """The YAML mapping in `path`, or the parser's error naming what is wrong with it (an
    option given twice too: YAML would keep the later value without a word)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as file:
            document = yaml.compose(file, Loader=yaml.SafeLoader)
    except OSError as error:
        parser.error(f"--config {path}: {error.strerror}")
    except yaml.YAMLError as error:
        parser.error(f"--config {path}: not valid YAML ({error})")
    if document is None:
        return {}
    if not isinstance(document, yaml.MappingNode):
        parser.error(f"--config {path}: must be a mapping of option names to values")
    keys = [str(key.value).replace("-", "_") for key, _ in document.value]  # one option
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        parser.error(f"--config {path}: {', '.join(map(repr, twice))} given more than once")
    try:
        return yaml.SafeLoader("").construct_document(document)
    except yaml.YAMLError as error:
        parser.error(f"--config {path}: not valid YAML ({error})")


def _command_module(name: str):
    return importlib.import_module(f"pagedkv.commands.{name}")


if __name__ == "__main__":
    raise SystemExit(main())
