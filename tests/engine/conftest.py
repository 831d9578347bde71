"""Tiny seeded models for engine tests, loaded through the real loader, with their oracles."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pagedkv.engine import LLM, Engine, EngineArgs
from tests.conftest import TinyZoo


@pytest.fixture(scope="session")
def engine_zoo(tmp_path_factory: pytest.TempPathFactory) -> TinyZoo:
    """Every tiny model family saved as a Hugging Face folder, with transformers as oracle."""
    return TinyZoo(tmp_path_factory.mktemp("engine_models"))


def make_engine(zoo: TinyZoo, name: str = "llama", **overrides: Any) -> Engine:
    """An engine over tiny model `name`; small pools unless the test says otherwise."""
    settings: dict[str, Any] = dict(num_gpu_blocks=128, swap_space_gb=0.01, max_model_len=1024)
    settings.update(overrides)
    return Engine(EngineArgs(model=str(zoo.folder(name)), **settings))


def make_llm(zoo: TinyZoo, name: str = "llama", **overrides: Any) -> LLM:
    """An `LLM` over tiny model `name` with the same small defaults as `make_engine`."""
    settings: dict[str, Any] = dict(num_gpu_blocks=128, swap_space_gb=0.01, max_model_len=1024)
    settings.update(overrides)
    return LLM(str(zoo.folder(name)), **settings)


def run_to_completion(engine: Engine) -> Iterator[list]:
    """Step until nothing is left, checking the memory invariants after every step."""
    while engine.has_unfinished():
        yield engine.step()
        engine.manager.check_invariants()


def interrupt_the_second_admission(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (KeyboardInterrupt) while the scheduler admits the second waiting request of a
    step, once: the first is admitted by then (its blocks allocated, published, its moves
    planned). Later admissions run as usual."""
    real_try_admit = engine.scheduler._try_admit
    calls: list[int] = []

    def try_admit(request, step):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_try_admit(request, step)

    monkeypatch.setattr(engine.scheduler, "_try_admit", try_admit)
