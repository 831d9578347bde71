"""Tests of the scripts in bench/, which are not a package: `load_script` imports one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_script(name: str) -> ModuleType:
    """bench/`name`.py as module `bench_<name>`, loaded with bench/ on the import path, as when
    run from there (the scripts import their sibling peers.py)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))
