"""pagedkv against its peers on one GGUF file: llama.cpp and transformers `generate`.

Why: `pagedkv bench` compares the engine with transformers only, on float weights. This
answers "how far from llama.cpp are we", on the same quantised file, the same prompts and the
same threads, in ONE run whose rounds alternate (round r: pagedkv, llama.cpp, transformers),
so a change in a shared machine's load touches every system alike. Figures per system:

- batch: 32 seeded random prompts of 32-256 tokens, 128 new tokens each (greedy, no EOS
  stop), all submitted at once; generated tokens / seconds of the whole (prefill + decode);
- batch-1: one 64-token prompt, 128 new tokens: decode tokens/s (the 127 tokens after the
  first over the time after the first) and whole-request tokens/s;
- prefill: one 256-token prompt, one new token: prompt tokens/s.

Besides, once per run: the machine's read bandwidth (a threaded sum over a buffer far larger
than the caches), the weight bytes a decoded token reads (every tensor of the file but the
embedding table, which a token reads one row of, unless the output shares it), so the
bandwidth limit of batch-1 decode and each system's fraction of it; and how long pagedkv's
`LLM()` took to be ready (its weights mapped from the packed cache after a first start).
`--model 1b` is a seeded random model of TinyLlama-1.1B's shape (`pagedkv.bench.model_1b`,
written once into the cache in `--qtype`).

llama.cpp runs in a subprocess under another interpreter (`--llama-python`, the virtual
environment holding llama-cpp-python, never a dependency of pagedkv) executing
`bench/llama_cpp_worker.py`, which batches the way llama-server does. transformers loads the
GGUF itself (dequantised to float32), or else pagedkv's converted float32 folder.

Run: `python bench/peers.py` (the built-in SmolLM2-135M-Instruct, 3 rounds); quick:
`--num-prompts 4 --max-tokens 16 --rounds 1`. `--help` lists every flag.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import torch

from pagedkv.bench.main import positive_int
from pagedkv.bench.model_1b import QTYPES as QTYPES_1B
from pagedkv.bench.transformers_baselines import load_hf_model, run_hf_generate
from pagedkv.bench.workloads import Workload, WorkloadSpec, make_workload
from pagedkv.quant.schemes import QUANTIZATIONS
from pagedkv.worker.threads import physical_cores

SYSTEMS = ("pagedkv", "llama.cpp", "transformers")
TITLES = {
    "pagedkv": "pagedkv",
    "llama.cpp": "llama.cpp (llama-cpp-python)",
    "transformers": "transformers generate",
}
DEFAULT_MODEL = "smollm2-135m-instruct"
PROMPT_LEN = (32, 256)
BATCH1_PROMPT_LEN = 64
PREFILL_PROMPT_LEN = 256
BANDWIDTH_BYTES = 2**30  # the buffer read to measure bandwidth: far past any cache
KV_SLACK = 256  # tokens of KV beyond what the batch needs, for pagedkv and llama.cpp alike
BLOCK_SIZE = 16
WORKER = Path(__file__).with_name("llama_cpp_worker.py")
LLAMA_VENV = Path("/work/llamacpp-venv")
INSTALL_HINT = (
    "install it in a separate virtual environment (never into pagedkv's): "
    "python -m venv /path && CMAKE_BUILD_PARALLEL_LEVEL=2 /path/bin/pip install "
    "llama-cpp-python (about 10 min on 2 cores), then pass --llama-python /path/bin/python "
    "or set PAGEDKV_LLAMA_PYTHON; on a CPU with AMX in a VM that does not enable it, llama.cpp's "
    "AMX matmul crashes: build with CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON "
    "-DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON' (the instructions the CPU has, no AMX)"
)


@dataclass(frozen=True)
class Measure:
    """One timed run: wall seconds, tokens generated, and when the first one came."""

    seconds: float
    generated_tokens: int
    first_token_seconds: float | None = None

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over the whole run (prefill included)."""
        return self.generated_tokens / self.seconds

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time after the first (one sequence's decode)."""
        if self.first_token_seconds is None or self.generated_tokens < 2:
            return None
        return (self.generated_tokens - 1) / (self.seconds - self.first_token_seconds)


class PeerUnavailable(Exception):
    """A peer that cannot run here; the benchmark skips it and says why."""


class Peer(Protocol):
    """A system under test, loaded: it runs prompts to exactly `max_tokens` new tokens."""

    name: str

    def describe(self) -> str: ...

    def run(self, prompts: list[list[int]], max_tokens: int) -> Measure: ...

    def close(self) -> None: ...


# --- the systems -------------------------------------------------------------------------


class PagedkvPeer:
    """`LLM(model=gguf)`: prefix caching off (every round sends the same prompts) and a KV
    pool of the same tokens as llama.cpp's context."""

    name = "pagedkv"

    def __init__(self, gguf: Path, quantization: str, threads: int, kv: int) -> None:
        from pagedkv import LLM

        started = time.perf_counter()
        self.llm = LLM(
            model=str(gguf),
            quantization=quantization,
            threads=threads,
            enable_prefix_caching=False,
            num_gpu_blocks=math.ceil(kv / BLOCK_SIZE),
            block_size=BLOCK_SIZE,
            swap_space_gb=0,
        )
        self.start_seconds = time.perf_counter() - started  # LLM() until ready to generate

    def describe(self) -> str:
        from pagedkv.model.footprint import weight_footprint

        footprint = weight_footprint(self.llm.engine.runner.model).describe()
        return f"pagedkv {footprint}; LLM() ready in {self.start_seconds:.2f} s"

    def close(self) -> None:
        pass

    def run(self, prompts: list[list[int]], max_tokens: int) -> Measure:
        from pagedkv import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        requests = [{"prompt_token_ids": prompt} for prompt in prompts]
        started = time.monotonic()  # the clock of the requests' metrics
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        seconds = time.monotonic() - started
        first = outputs[0].metrics.first_token_time
        return Measure(
            seconds,
            sum(len(output.outputs[0].token_ids) for output in outputs),
            None if first is None else first - started,
        )


class LlamaCppPeer:
    """llama-cpp-python in a subprocess (`bench/llama_cpp_worker.py`), one JSON job a line."""

    name = "llama.cpp"

    def __init__(self, python: Path, gguf: Path, threads: int, kv_unified: bool) -> None:
        self.gguf, self.threads, self.kv_unified = gguf, threads, kv_unified
        self.version = "?"
        # llama.cpp's own logs, kept for the message if the worker dies; closed by close()
        self.log: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.process = subprocess.Popen(
            [str(python), str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )

    def describe(self) -> str:
        kv = "one unified KV buffer" if self.kv_unified else "a KV stream per sequence"
        return f"llama.cpp: llama-cpp-python {self.version}, {self.gguf.name} as stored, {kv}"

    def run(self, prompts: list[list[int]], max_tokens: int) -> Measure:
        reply = self.ask(
            {
                "model": str(self.gguf),
                "threads": self.threads,
                "prompts": prompts,
                "max_tokens": max_tokens,
                "n_ctx": kv_tokens(prompts, max_tokens),
                "kv_unified": self.kv_unified,
            }
        )
        self.version = reply["version"]
        self.kv_unified = reply["kv_unified"]  # False where this llama.cpp lacks the option
        return Measure(reply["seconds"], reply["generated_tokens"], reply["first_token_seconds"][0])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)
        self.log.close()

    def ask(self, job: dict[str, Any]) -> dict[str, Any]:
        """Send one job to the worker; its reply (PeerUnavailable if it died or failed)."""
        try:
            self.process.stdin.write(json.dumps(job) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise PeerUnavailable(self._death())
        reply = json.loads(line)
        if "error" in reply:
            raise PeerUnavailable(f"llama.cpp worker: {reply['error']}")
        return reply

    def _death(self) -> str:
        code = self.process.wait(timeout=30)
        self.log.seek(0)
        tail = "\n".join(self.log.read().strip().splitlines()[-5:])
        if code == -signal.SIGILL:
            return (
                "llama.cpp worker died of Illegal instruction: this llama-cpp-python build "
                "uses CPU instructions this machine lacks (rebuild it here, e.g. "
                'CMAKE_ARGS="-DGGML_NATIVE=ON"); ' + INSTALL_HINT
            )
        output = tail or "(no output)"
        if code == -signal.SIGSEGV:  # a native build did this in a VM here; the no-AMX one ran
            return f"llama.cpp worker died of a segmentation fault: {output}; {INSTALL_HINT}"
        return f"llama.cpp worker exited with status {code}: {output}"


class TransformersPeer:
    """transformers `generate`, float32: the batch left-padded in one call (the baseline of
    `pagedkv bench`), batch-1 timed token by token through a streamer."""

    name = "transformers"

    def __init__(self, gguf: Path, model_name: str | None, threads: int) -> None:
        torch.set_num_threads(threads)
        self._temp: tempfile.TemporaryDirectory[str] | None = None
        self.model, self.source = self._load(gguf, model_name)

    def describe(self) -> str:
        import transformers

        return f"transformers {transformers.__version__}: {self.source}, float32"

    def close(self) -> None:
        if self._temp is not None:
            self._temp.cleanup()

    def run(self, prompts: list[list[int]], max_tokens: int) -> Measure:
        if len(prompts) == 1:
            return self._run_streamed(prompts[0], max_tokens)
        spec = WorkloadSpec(len(prompts), (1, 1), (max_tokens, max_tokens))
        workload = Workload("peers", spec, 0, prompts, [max_tokens] * len(prompts))
        result = run_hf_generate(self.model, workload, 0, batch_size=len(prompts))
        return Measure(result.seconds, result.generated_tokens)

    def _run_streamed(self, prompt: list[int], max_tokens: int) -> Measure:
        from transformers.generation.streamers import BaseStreamer

        started = time.perf_counter()
        stamps: list[float] = []

        class Clock(BaseStreamer):  # put() gets the prompt first, then each new token
            def put(self, value: torch.Tensor) -> None:
                stamps.append(time.perf_counter() - started)

            def end(self) -> None:
                pass

        with torch.inference_mode():
            output = self.model.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,  # ignore_eos
                do_sample=False,
                pad_token_id=0,
                streamer=Clock(),
            )
        seconds = time.perf_counter() - started
        first = stamps[1] if len(stamps) > 1 else None
        return Measure(seconds, output.shape[1] - len(prompt), first)

    def _load(self, gguf: Path, model_name: str | None) -> tuple[Any, str]:
        """The GGUF through transformers' own reader, else pagedkv's float32 conversion."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
            return model.eval(), f"{gguf.name} read by transformers' GGUF loader"
        except Exception as error:  # an architecture or block type it does not read
            reason = f"{type(error).__name__}: {error}"
        if model_name is not None:
            from pagedkv.weights.load import converted_folder

            folder = converted_folder(model_name)
        else:
            from pagedkv.weights.gguf.convert import convert_gguf

            self._temp = tempfile.TemporaryDirectory(prefix="peers-hf-")
            folder = convert_gguf(gguf, Path(self._temp.name) / "hf")
        source = f"pagedkv's float32 conversion {folder} (transformers' GGUF loader: {reason})"
        return load_hf_model(str(folder)), source


# --- the run -----------------------------------------------------------------------------


@dataclass
class Config:
    """What one invocation runs."""

    gguf: Path
    model_name: str | None  # a built-in name, when given one
    systems: list[str]
    rounds: int
    num_prompts: int
    max_tokens: int
    threads: int
    quantization: str
    seed: int
    llama_python: Path | None
    llama_kv_unified: bool = True


def run_peers(config: Config, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Load the systems, warm each up, run the rounds, print the tables; return the figures."""
    vocab_size = _vocab_size(config.gguf)
    batch = make_workload(
        "peers",
        WorkloadSpec(config.num_prompts, PROMPT_LEN, (config.max_tokens, config.max_tokens)),
        vocab_size,
        config.seed,
    )
    single = make_workload(
        "peers-batch-1",
        WorkloadSpec(1, (BATCH1_PROMPT_LEN, BATCH1_PROMPT_LEN), (config.max_tokens,) * 2),
        vocab_size,
        config.seed,
    )
    prefill = make_workload(
        "peers-prefill",
        WorkloadSpec(1, (PREFILL_PROMPT_LEN, PREFILL_PROMPT_LEN), (1, 1)),
        vocab_size,
        config.seed,
    )
    load_before = os.getloadavg()[0]
    bandwidth = read_bandwidth(config.threads)
    bytes_per_token = weight_bytes_per_token(config.gguf)
    peers, skipped = load_peers(config, kv_tokens(batch.prompts, config.max_tokens))
    report: dict[str, Any] = {
        "model": config.model_name or str(config.gguf),
        "gguf": str(config.gguf),
        "threads": config.threads,
        "quantization": config.quantization,
        "rounds": config.rounds,
        "seed": config.seed,
        "batch": {"num_prompts": config.num_prompts, "prompt_tokens": _prompt_tokens(batch)},
        "batch1_prompt_tokens": BATCH1_PROMPT_LEN,
        "prefill_prompt_tokens": PREFILL_PROMPT_LEN,
        "max_tokens": config.max_tokens,
        "read_bandwidth_bytes_per_s": bandwidth,
        "weight_bytes_per_token": bytes_per_token,
        "bandwidth_limit_tokens_per_s": bandwidth / bytes_per_token,
        "kv_tokens": kv_tokens(batch.prompts, config.max_tokens),
        "llama_kv_unified": config.llama_kv_unified,
        "load_average_before": load_before,
        "versions": {"torch": torch.__version__},
        "skipped": skipped,
        "systems": {},
    }
    try:
        ready = _warmed_up(peers, _warm_up_prompts(vocab_size), skipped)
        out(_header(config, batch, ready, skipped, load_before))
        runs = _run_rounds(config, ready, [batch, single, prefill], out)
        report["pagedkv_start_seconds"] = next(
            (p.start_seconds for p in ready if isinstance(p, PagedkvPeer)), None
        )
    finally:
        for peer in peers:
            peer.close()
    report["load_average_after"] = os.getloadavg()[0]
    report["versions"] |= _versions(ready)
    report["systems"] = _figures(runs)
    report["ratios"] = _ratios(report["systems"])
    _print_table(config, report, out)
    return report


def load_peers(config: Config, kv: int) -> tuple[list[Peer], dict[str, str]]:
    """The systems asked for, loaded; those that cannot run here, with the reason."""
    peers: list[Peer] = []
    skipped: dict[str, str] = {}
    for system in config.systems:
        try:
            if system == "pagedkv":
                peers.append(PagedkvPeer(config.gguf, config.quantization, config.threads, kv))
            elif system == "llama.cpp":
                if config.llama_python is None or not config.llama_python.exists():
                    raise PeerUnavailable(f"no llama-cpp-python interpreter; {INSTALL_HINT}")
                peers.append(
                    LlamaCppPeer(
                        config.llama_python, config.gguf, config.threads, config.llama_kv_unified
                    )
                )
            else:
                peers.append(TransformersPeer(config.gguf, config.model_name, config.threads))
        except PeerUnavailable as reason:
            skipped[system] = str(reason)
    return peers, skipped


def _warmed_up(peers: list[Peer], prompts: list[list[int]], skipped: dict[str, str]) -> list[Peer]:
    """One short run per system, outside any timing; a peer that fails it is skipped."""
    ready = []
    for peer in peers:
        try:
            peer.run(prompts, 4)
            ready.append(peer)
        except PeerUnavailable as reason:
            skipped[peer.name] = str(reason)
    return ready


def _run_rounds(
    config: Config, peers: list[Peer], workloads: list[Workload], out: Callable[[str], None]
) -> dict[str, list[dict[str, Any]]]:
    """Round r runs every system, batch, batch-1 then prefill, in the fixed order of SYSTEMS."""
    batch, single, prefill = workloads
    runs: dict[str, list[dict[str, Any]]] = {peer.name: [] for peer in peers}
    for round_index in range(config.rounds):
        for peer in peers:
            whole = peer.run(batch.prompts, config.max_tokens)
            one = peer.run(single.prompts, config.max_tokens)
            first = peer.run(prefill.prompts, 1)
            runs[peer.name].append(
                {"batch": asdict(whole), "batch1": asdict(one), "prefill": asdict(first)}
            )
            decode = one.decode_tokens_per_s
            out(
                f"  round {round_index + 1}  {TITLES[peer.name]:<28} batch "
                f"{whole.seconds:7.2f} s {whole.tokens_per_s:8.1f} tok/s | batch-1 decode "
                f"{_num(decode)} tok/s, request {one.tokens_per_s:6.1f} tok/s | prefill "
                f"{PREFILL_PROMPT_LEN / first.seconds:7.1f} tok/s"
            )
    return runs


def _figures(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per system: each round's tokens/s and tokens, and their median, min and max."""
    figures: dict[str, Any] = {}
    for system, rounds in runs.items():
        batch = [Measure(**r["batch"]) for r in rounds]
        single = [Measure(**r["batch1"]) for r in rounds]
        prefill = [Measure(**r["prefill"]) for r in rounds]
        figures[system] = {
            "batch_tokens_per_s": _spread([m.tokens_per_s for m in batch]),
            "prefill_tokens_per_s": _spread([PREFILL_PROMPT_LEN / m.seconds for m in prefill]),
            "batch1_decode_tokens_per_s": _spread([m.decode_tokens_per_s for m in single]),
            "batch1_request_tokens_per_s": _spread([m.tokens_per_s for m in single]),
            "batch_generated_tokens": [m.generated_tokens for m in batch],
            "batch1_generated_tokens": [m.generated_tokens for m in single],
            "rounds": rounds,
        }
    return figures


def _spread(values: list[float | None]) -> dict[str, Any]:
    known = [v for v in values if v is not None]
    if not known:
        return {"median": None, "min": None, "max": None, "per_round": values}
    return {
        "median": statistics.median(known),
        "min": min(known),
        "max": max(known),
        "per_round": values,
    }


def _ratios(systems: dict[str, Any]) -> dict[str, Any]:
    """pagedkv's median over each peer's, for the batch and batch-1 decode."""
    if "pagedkv" not in systems:
        return {}
    ours = systems["pagedkv"]
    ratios = {}
    for system in ("llama.cpp", "transformers"):
        if system not in systems:
            continue
        ratios[f"pagedkv/{system}"] = {
            key: _divide(ours[key]["median"], systems[system][key]["median"])
            for key in ("batch_tokens_per_s", "batch1_decode_tokens_per_s", "prefill_tokens_per_s")
        }
    return ratios


def _header(
    config: Config,
    batch: Workload,
    peers: list[Peer],
    skipped: dict[str, str],
    load_before: float,
) -> str:
    lines = [
        f"peers: {config.model_name or config.gguf.name} ({config.gguf}), "
        f"threads {config.threads} for every system, quantization {config.quantization} "
        f"(pagedkv), rounds {config.rounds} (each: {', '.join(p.name for p in peers)})",
        f"batch: {config.num_prompts} prompts of {PROMPT_LEN[0]}-{PROMPT_LEN[1]} tokens (seed "
        f"{config.seed}; {_prompt_tokens(batch)} prompt tokens), {config.max_tokens} new each, "
        f"greedy, ignore_eos: {config.num_prompts * config.max_tokens} tokens; KV "
        f"{kv_tokens(batch.prompts, config.max_tokens)} tokens for pagedkv and llama.cpp",
        f"batch-1: one {BATCH1_PROMPT_LEN}-token prompt, {config.max_tokens} new tokens",
        *(f"  {peer.describe()}" for peer in peers),
        *(f"  skipped {system}: {reason}" for system, reason in skipped.items()),
        f"load average (1 min) before: {load_before:.2f} on {os.cpu_count()} CPUs",
    ]
    return "\n".join(lines)


def _print_table(config: Config, report: dict[str, Any], out: Callable[[str], None]) -> None:
    out("")
    out(
        f"{'system':<28} {'batch tok/s (min-max)':>26} {'batch-1 decode (min-max)':>26} "
        f"{'batch-1 request':>16} {'prefill tok/s (min-max)':>26}"
    )
    for system, figures in report["systems"].items():
        out(
            f"{TITLES[system]:<28} {_cell(figures['batch_tokens_per_s']):>26} "
            f"{_cell(figures['batch1_decode_tokens_per_s']):>26} "
            f"{_num(figures['batch1_request_tokens_per_s']['median']):>16} "
            f"{_cell(figures['prefill_tokens_per_s']):>26}"
        )
    for name, ratios in report["ratios"].items():
        out(
            f"{name}: batch {_times(ratios['batch_tokens_per_s'])}, batch-1 decode "
            f"{_times(ratios['batch1_decode_tokens_per_s'])}, prefill "
            f"{_times(ratios['prefill_tokens_per_s'])} (medians)"
        )
    limit = report["bandwidth_limit_tokens_per_s"]
    out(
        f"read bandwidth {report['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; weights read "
        f"per decoded token {report['weight_bytes_per_token'] / 1e6:.1f} MB: batch-1 decode "
        f"limit {limit:.1f} tok/s"
    )
    for system, figures in report["systems"].items():
        decode = figures["batch1_decode_tokens_per_s"]["median"]
        if decode is not None:
            out(f"  {TITLES[system]}: batch-1 decode at {decode / limit:.0%} of the limit")
    if report.get("pagedkv_start_seconds") is not None:
        out(f"pagedkv LLM() ready in {report['pagedkv_start_seconds']:.2f} s")
    versions = ", ".join(f"{name} {version}" for name, version in report["versions"].items())
    out(
        f"threads {config.threads}, quantization {config.quantization}; {versions}; load "
        f"average (1 min) before {report['load_average_before']:.2f}, after "
        f"{report['load_average_after']:.2f}"
    )


def _versions(peers: list[Peer]) -> dict[str, str]:
    versions = {}
    for peer in peers:
        if isinstance(peer, LlamaCppPeer):
            versions["llama-cpp-python"] = peer.version
        elif isinstance(peer, TransformersPeer):
            import transformers

            versions["transformers"] = transformers.__version__
    return versions


def kv_tokens(prompts: list[list[int]], max_tokens: int) -> int:
    """KV tokens for a run: every sequence at the longest's length, plus slack; llama.cpp's
    n_ctx (kv_unified: all sequences share it), and pagedkv's pool for the batch."""
    return len(prompts) * (max(map(len, prompts)) + max_tokens) + KV_SLACK


def read_bandwidth(threads: int, repeats: int = 5) -> float:
    """Bytes per second of a threaded sum over `BANDWIDTH_BYTES` of float32 (best of
    `repeats`): what streaming weights from memory can reach on this machine."""
    torch.set_num_threads(threads)
    buffer = torch.ones(BANDWIDTH_BYTES // 4)
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return BANDWIDTH_BYTES / best


def weight_bytes_per_token(gguf: Path) -> int:
    """Bytes of weights one decoded token reads from the file: every tensor, except that of the
    embedding table only a row is read, unless the output layer is the same table."""
    from pagedkv.weights.gguf.file import GGUFFile

    tensors = GGUFFile(gguf).tensors
    total = sum(tensor.data.nbytes for tensor in tensors.values())
    embedding = tensors["token_embd.weight"]
    if "output.weight" in tensors:  # untied: the table is read a row at a time
        total -= embedding.data.nbytes - embedding.data.nbytes // int(embedding.shape[1])
    return total


def _warm_up_prompts(vocab_size: int) -> list[list[int]]:
    spec = WorkloadSpec(2, (8, 8), (4, 4))
    return make_workload("warm-up", spec, vocab_size, 0).prompts


def _vocab_size(gguf: Path) -> int:
    from pagedkv.weights.gguf.model import GGUFModel

    return GGUFModel.open(gguf).config.vocab_size


def _prompt_tokens(workload: Workload) -> int:
    return sum(map(len, workload.prompts))


def _divide(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:6.1f}"


def _cell(spread: dict[str, Any]) -> str:
    if spread["median"] is None:
        return "-"
    return f"{spread['median']:.1f} ({spread['min']:.1f}-{spread['max']:.1f})"


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


# --- the command line --------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="peers", description=__doc__.splitlines()[0] if __doc__ else None
    )
    add_model_arguments(parser)
    parser.add_argument("--rounds", type=positive_int, default=3, help="rounds (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts (default: 0)")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads for every system (default: this machine's physical cores)",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="auto",
        help="pagedkv's weights: auto (the GGUF's own blocks), none, int8, int4 (default: auto)",
    )
    parser.add_argument(
        "--num-prompts", type=positive_int, default=32, help="prompts in the batch (default: 32)"
    )
    parser.add_argument(
        "--max-tokens", type=positive_int, default=128, help="new tokens per prompt (default: 128)"
    )
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all)",
    )
    parser.add_argument(
        "--llama-python",
        type=Path,
        default=None,
        help="python of the virtual environment with llama-cpp-python (default: "
        f"$PAGEDKV_LLAMA_PYTHON, else {LLAMA_VENV}/bin/python if it exists)",
    )
    parser.add_argument(
        "--llama-kv-unified",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="llama.cpp: one KV buffer shared by all sequences (kv_unified; default: on), or "
        "a stream of n_ctx / n_seq cells per sequence (llama-server's -np default)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    return parser.parse_args(argv)


def make_config(args: argparse.Namespace) -> Config:
    """Resolve the model to a GGUF file, the systems, the threads and llama.cpp's python."""
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise SystemExit(f"peers: --systems takes {','.join(SYSTEMS)}, got {args.systems!r}")
    gguf = model_file(args.model, args.qtype, "peers")
    builtin = args.model != "1b" and not args.model.endswith(".gguf")
    model_name = args.model if builtin else None
    return Config(
        gguf=gguf.resolve(),
        model_name=model_name,
        systems=[s for s in SYSTEMS if s in systems],
        rounds=args.rounds,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        threads=args.threads or physical_cores(),
        quantization=args.quantization,
        seed=args.seed,
        llama_python=_llama_python(args.llama_python),
        llama_kv_unified=args.llama_kv_unified,
    )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--model` and `--qtype`, the two that `model_file` takes (this script's and its
    siblings')."""
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a built-in model name, 1b (a random model of TinyLlama-1.1B's shape, in "
        f"--qtype) or a .gguf file (default: {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--qtype",
        choices=QTYPES_1B,
        default="Q4_1",
        help="block type of --model 1b (default: Q4_1)",
    )


def model_file(model: str, qtype: str, prog: str) -> Path:
    """The GGUF file of a `--model`: 1b (TinyLlama-1.1B's shape in `qtype`), a .gguf path, or
    a built-in model's (pulled if needed); `prog` names the script in errors."""
    if model == "1b":
        from pagedkv.bench.model_1b import model_1b_path

        return model_1b_path(qtype)
    if model.endswith(".gguf"):
        if not Path(model).is_file():
            raise SystemExit(f"{prog}: no such file {model}")
        return Path(model)
    from pagedkv.hub import pull

    return pull(model, progress=lambda line: print(line, file=sys.stderr))


def _llama_python(given: Path | None) -> Path | None:
    if given is not None:
        return given
    if os.environ.get("PAGEDKV_LLAMA_PYTHON"):
        return Path(os.environ["PAGEDKV_LLAMA_PYTHON"])
    default = LLAMA_VENV / "bin" / "python"
    return default if default.exists() else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 1 when a system generated other than the tokens asked for."""
    args = parse_args(argv)
    config = make_config(args)
    report = run_peers(config)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    wrong = _token_count_errors(config, report)
    for line in wrong:
        print(f"peers: token count mismatch: {line}")
    return 1 if wrong else 0


def _token_count_errors(config: Config, report: dict[str, Any]) -> list[str]:
    expected = {
        "batch_generated_tokens": config.num_prompts * config.max_tokens,
        "batch1_generated_tokens": config.max_tokens,
    }
    return [
        f"{system} {key}: {count}, expected {want}"
        for system, figures in report["systems"].items()
        for key, want in expected.items()
        for count in figures[key]
        if count != want
    ]


if __name__ == "__main__":
    sys.exit(main())
