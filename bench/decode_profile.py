"""Where a batch-1 decode step's time goes, against the time its weights take to stream.

Why: at one sequence every decoded token reads every weight once, so the step can be no
faster than (weight bytes read per token) / (the machine's read bandwidth). What a step spends
beyond that floor is its fixed cost: the C call's own overhead, the layers' other work
(attention, norms, RoPE), the output layer, sampling and the Python of the step between. This
prints each part, per decoded token, so the target is a figure, not a guess.

The parts are timed by wrapping the engine's own stage functions for the run (nothing in the
engine is changed): `Engine.step` (the whole step), `Scheduler.schedule`, the KV plan and the
batch build (`ModelRunner.execute` less the model), the model's forward pass and in it the one
C call over the decoder layers (`CPUAttention.decode_layers`) and the output layer, the
sampler, `Scheduler.update`, and the engine's per-request output (`Engine._delta`, the
detokeniser). Only decode steps count: those whose C call took one row (a prompt's chunk goes
through the same call, and would add its prefill to the decode figures).

The floors: the bytes of the file's weights a token reads (bench/peers.py's rule) over the
read bandwidth (a threaded sum far past the caches), and the same for the bytes resident
in memory as the kernels read them (the packed layout, `weight_footprint`).

Run: `python bench/decode_profile.py` (the built-in model); `--model 1b` for the 1B shape.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import (  # noqa: E402
    add_model_arguments,
    model_file,
    read_bandwidth,
    weight_bytes_per_token,
)

from pagedkv.bench.main import positive_int  # noqa: E402
from pagedkv.worker.threads import physical_cores  # noqa: E402


class StepTimes:
    """Seconds per labelled part, kept per step so the prompt's step can be left out."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def wrap(self, owner: object, name: str, label: str) -> Callable[[], None]:
        """Time every call of `owner.name` under `label`; returns the undo."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if self.steps:
                    part = self.steps[-1]
                    part[label] = part.get(label, 0.0) + time.perf_counter() - started

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)

    def new_step(self) -> None:
        self.steps.append({})

    def count_rows(self, owner: object, name: str) -> Callable[[], None]:
        """Note the rows of every call of `owner.name` (its first argument's) as the step's
        "rows"; returns the undo."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def counted(self_, hidden, *args, **kwargs):
            if self.steps:
                self.steps[-1]["rows"] = hidden.shape[0]
            return original(self_, hidden, *args, **kwargs)

        setattr(owner, name, counted)
        return lambda: setattr(owner, name, original)


@contextmanager
def timed_engine(llm, times: StepTimes) -> Iterator[None]:
    """The engine's stages wrapped for the duration (see the module docstring)."""
    from pagedkv.attention.backend import CPUAttention
    from pagedkv.engine.engine import Engine
    from pagedkv.engine.sampler import Sampler
    from pagedkv.engine.sched.scheduler import Scheduler
    from pagedkv.model.decoder import DecoderModel
    from pagedkv.worker.runner import ModelRunner

    model = llm.engine.runner.model
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    head_name = "forward" if model.lm_head is not None else "logits"
    original_step = Engine.step

    def step(engine):
        times.new_step()
        started = time.perf_counter()
        try:
            return original_step(engine)
        finally:
            times.steps[-1]["step"] = time.perf_counter() - started

    Engine.step = step
    undo = [
        lambda: setattr(Engine, "step", original_step),
        times.wrap(Scheduler, "schedule", "schedule"),
        times.wrap(ModelRunner, "execute", "runner"),
        times.wrap(DecoderModel, "forward", "model"),
        times.wrap(CPUAttention, "decode_layers", "layers (one C call)"),
        times.count_rows(CPUAttention, "decode_layers"),
        times.wrap(head, head_name, "output layer"),
        times.wrap(Sampler, "__call__", "sample"),
        times.wrap(Scheduler, "update", "update"),
        times.wrap(Engine, "_delta", "outputs (detokenise)"),
    ]
    try:
        yield
    finally:
        for restore in reversed(undo):
            restore()


def resident_bytes_per_token(model) -> int:
    """Bytes the kernels read per decoded token as the weights sit in memory: every matrix
    and vector, except an untied embedding table, of which a token reads one row."""
    from pagedkv.model.footprint import weight_footprint

    total = weight_footprint(model).resident_bytes
    if model.lm_head is not None:
        table = model.embed_tokens
        qweight = getattr(table, "qweight", None)
        size = qweight.nbytes if qweight is not None else table.weight.nbytes
        total -= size - size // model.config.vocab_size
    return total


def profile(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, float]:
    """Run the measurement; returns milliseconds per decoded token by part."""
    from pagedkv import LLM, SamplingParams

    gguf = model_file(args.model, args.qtype, "decode_profile")
    bandwidth = read_bandwidth(args.threads)
    llm = LLM(
        model=str(gguf),
        threads=args.threads,
        enable_prefix_caching=False,
        num_gpu_blocks=math.ceil((args.prompt_len + args.max_tokens) / 16) + 1,
        swap_space_gb=0,
    )
    model = llm.engine.runner.model
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    span = min(1000, model.config.vocab_size - 10)  # ids 10 .. 1009, or the vocabulary's
    prompt = {"prompt_token_ids": [(7 + 31 * i) % span + 10 for i in range(args.prompt_len)]}
    llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    times = StepTimes()
    with timed_engine(llm, times):
        for _ in range(args.rounds):
            llm.generate([prompt], params, use_tqdm=False)
    decode = [step for step in times.steps if step.pop("rows", None) == 1]
    if not decode:
        raise SystemExit("decode_profile: no step took the one-call C decode")
    ms = {label: 1e3 * sum(s.get(label, 0.0) for s in decode) / len(decode) for label in decode[0]}
    for label in ("schedule", "runner", "model", "sample", "update", "outputs (detokenise)"):
        ms.setdefault(label, 0.0)
    ms["KV plan + batch build"] = ms["runner"] - ms["model"]
    ms["embed, RoPE tables, final norm"] = (
        ms["model"] - ms["layers (one C call)"] - ms.get("output layer", 0.0)
    )
    ms["step, the rest (Python between)"] = ms["step"] - sum(
        ms[label] for label in ("schedule", "runner", "sample", "update", "outputs (detokenise)")
    )
    file_bytes = weight_bytes_per_token(gguf)
    resident = resident_bytes_per_token(model)
    ms["floor: file bytes / bandwidth"] = 1e3 * file_bytes / bandwidth
    ms["floor: resident bytes / bandwidth"] = 1e3 * resident / bandwidth
    out(
        f"{gguf.name}: batch-1 decode, {args.prompt_len}-token prompt + {args.max_tokens} new, "
        f"{args.rounds} rounds, {len(decode)} decode steps, {args.threads} threads"
    )
    out(
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s; weights read per token: "
        f"{file_bytes / 1e6:.1f} MB in the file, {resident / 1e6:.1f} MB resident"
    )
    step = ms["step"]
    rows = [
        ("whole step", step),
        ("  schedule", ms["schedule"]),
        ("  KV plan + batch build", ms["KV plan + batch build"]),
        ("  model forward", ms["model"]),
        ("    decoder layers (one C call)", ms["layers (one C call)"]),
        ("    output layer", ms.get("output layer", 0.0)),
        ("    embed, RoPE tables, final norm", ms["embed, RoPE tables, final norm"]),
        ("  sample", ms["sample"]),
        ("  scheduler update", ms["update"]),
        ("  outputs (detokenise)", ms["outputs (detokenise)"]),
        ("  the rest of the step", ms["step, the rest (Python between)"]),
        ("floor: resident bytes / bandwidth", ms["floor: resident bytes / bandwidth"]),
        ("floor: file bytes / bandwidth", ms["floor: file bytes / bandwidth"]),
    ]
    out(f"{'part':38} {'ms/token':>9} {'of step':>8}")
    for label, value in rows:
        out(f"{label:38} {value:9.3f} {value / step:8.1%}")
    out(
        f"decode {1e3 / step:.1f} tok/s; the bandwidth limit of the file's bytes "
        f"{1e3 / ms['floor: file bytes / bandwidth']:.1f} tok/s "
        f"({ms['floor: file bytes / bandwidth'] / step:.0%} of it reached); outside the "
        f"C call {step - ms['layers (one C call)']:.3f} ms a token"
    )
    return ms


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="decode_profile", description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens")
    parser.add_argument("--max-tokens", type=positive_int, default=128, help="new tokens")
    parser.add_argument("--rounds", type=positive_int, default=3, help="requests, one by one")
    parser.add_argument(
        "--threads", type=positive_int, default=physical_cores(), help="CPU threads"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    profile(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
