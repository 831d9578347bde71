"""The package's layout keeps its promises: one-way arrows between rooms, no import cycles.

Every `import` in `src/pagedkv` is read with `ast` (function-local and type-only imports
included: they are dependencies too) and checked against the rooms' order:
commands -> server, sim, bench -> engine -> worker -> weights -> tokenizer -> model ->
attention, quant -> kernels, parallel -> memory, kvmath, hub, hf_cache. A room imports only
from rooms below it, so nothing imports upward and no two rooms import each other; within a
room, no two modules import each other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "pagedkv"
# Rooms of `pagedkv`, lowest first; a room imports only from rooms of a lower rank.
RANKS = {
    "kvmath": 0,
    "memory": 0,
    "hub": 0,
    "hf_cache": 0,
    "kernels": 1,
    "parallel": 1,
    "attention": 2,
    "quant": 2,
    "model": 3,
    "tokenizer": 4,
    "weights": 5,
    "worker": 6,
    "engine": 7,
    "server": 8,
    "sim": 8,
    "bench": 8,
    "commands": 9,
    "cli": 10,
    "__init__": 10,
    "sampling_params": 10,  # vLLM's import paths of the engine's names
    "outputs": 10,
    "inputs": 10,
    "__main__": 11,  # `python -m pagedkv`: the command line
    "utils": 11,  # vLLM's import path of the command line's parser
}
TORCH_FREE = ("kvmath", "memory", "hub", "hf_cache")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path) -> Iterator[str]:
    """Every module name `path` imports, resolved to a module of ours when it is one."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                yield submodule if submodule in MODULES else node.module


def graph() -> dict[str, set[str]]:
    return {
        name: {target for target in imports_of(path) if target in MODULES and target != name}
        for name, path in MODULES.items()
    }


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_room_has_a_rank() -> None:
    assert {room(name) for name in MODULES} <= set(RANKS)


def test_rooms_import_only_from_lower_rooms() -> None:
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in graph().items()
        for target in targets
        if room(source) != room(target) and RANKS[room(target)] >= RANKS[room(source)]
    )
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_no_two_modules_import_each_other_directly_or_around_a_cycle() -> None:
    edges = graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize("room_name", TORCH_FREE)
def test_the_arithmetic_and_memory_rooms_never_import_torch(room_name: str) -> None:
    for name, path in MODULES.items():
        if room(name) == room_name:
            heavy = {target for target in imports_of(path) if target.split(".")[0] == "torch"}
            assert not heavy, f"{name} imports {heavy}"


def test_the_checker_sees_a_planted_upward_import(tmp_path: Path) -> None:
    """An import from the memory room up into the engine is named (the check can fail)."""
    planted = tmp_path / "planted.py"
    planted.write_text("from pagedkv.engine.sched.scheduler import Scheduler\n")
    targets = set(imports_of(planted))
    assert "pagedkv.engine.sched.scheduler" in targets
    assert RANKS[room("pagedkv.engine.sched.scheduler")] > RANKS[room("pagedkv.memory.pool")]


def test_long_modules_say_why_they_are_one_idea() -> None:
    """A module past about 400 lines explains in its docstring why it is not split."""
    unexplained = []
    for name, path in MODULES.items():
        source = path.read_text(encoding="utf-8")
        docstring = ast.get_docstring(ast.parse(source)) or ""
        if source.count("\n") > 420 and "400 lines" not in docstring:
            unexplained.append(f"{name}: {source.count(chr(10))} lines")
    assert not unexplained, "long modules without a reason:\n" + "\n".join(unexplained)
