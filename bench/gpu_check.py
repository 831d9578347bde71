"""Figures for the GPU check (issue 11): kernel bandwidth, paged vs dense, engine vs transformers.

`bench/gpu_check.sh` runs ``kernels`` and ``engine`` on a CUDA machine and collects what they
print into one results file. Every figure is measured side by side in one run:

- kernels: decode attention bandwidth (bytes of K/V read / time) at 64 x 4,096 and at mixed
  contexts (63 x 256 + 1 x 32,768), both against a device-to-device copy's bandwidth (read +
  written); paged decode vs dense SDPA over contiguous K/V; a few decode launch configurations;
  paged prefill vs dense causal SDPA. Kernel times are CUDA-event timings of CUDA-graph replays
  (a graph of many calls, so host launch cost is not counted), median of several replays.
- engine: generated tokens/s of `pagedkv.LLM` on a seeded random ~1B Llama in bf16, 48
  prompts of 32-256 tokens with 16-512 output tokens each (ignore_eos, greedy), against
  transformers' batched `generate` on the same weights and prompts.
- agreement: the engine's answers on the device against transformers' on the same float32
  weights: prompts of mixed lengths, some sharing a prefix (cache hits), in small chunks, greedy
  with logprobs; every generated token is checked against transformers' logits of the whole
  sequence (teacher-forced), with the float32 and the fp8 KV cache, and with speculative
  decoding (n-gram drafts, and the model drafting for itself).

``--device cpu`` runs the same code paths at tiny shapes (Triton's interpreter, the engine on
the CPU, float32): a dry run of the script, whose numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Setup:
    """Shapes and repeat counts for one device kind."""

    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    uniform: tuple[int, int]  # (batch, context)
    mixed: tuple[int, int, int, int]  # (short seqs, short context, long seqs, long context)
    prefill: tuple[int, int]  # (prompts, tokens each)
    copy_bytes: int
    calls_per_graph: int
    replays: int
    model: dict[str, int]  # LlamaConfig sizes of the random model
    workload: tuple[int, int, int, int, int]  # prompts, prompt min/max, output min/max


GPU = Setup(
    dtype=torch.bfloat16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    uniform=(64, 4096),
    mixed=(63, 256, 1, 32768),
    prefill=(4, 2048),
    copy_bytes=2 << 30,
    calls_per_graph=20,
    replays=7,
    model=dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    workload=(48, 32, 256, 16, 512),
)
CPU = Setup(
    dtype=torch.float32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    uniform=(3, 64),
    mixed=(2, 16, 1, 600),
    prefill=(2, 40),
    copy_bytes=1 << 20,
    calls_per_graph=1,
    replays=1,
    model=dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    workload=(4, 8, 24, 2, 6),
)


def main() -> None:
    """Parse the command line and run one part of the check."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["kernels", "engine", "agreement"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel is defined
    elif not torch.cuda.is_available():
        parser.error("no CUDA device (torch.cuda.is_available() is False); --device cpu dry-runs")
    device = torch.device(args.device)
    setup = GPU if device.type == "cuda" else CPU
    torch.manual_seed(0)
    if args.part == "kernels":
        run_kernels(setup, device)
    elif args.part == "engine":
        run_engine(setup, device)
    else:
        run_agreement(setup, device)
        run_lora_agreement(setup, device)


# ---------------------------------------------------------------------------- kernels


def run_kernels(setup: Setup, device: torch.device) -> None:
    """Decode bandwidth against a copy, paged vs dense, launch configurations, prefill."""
    from pagedkv.attention.triton.attention import DecodeConfig, PrefillConfig

    copy_bw = copy_bandwidth(setup, device)
    print(f"device-to-device copy: {fmt_bw(copy_bw)} (bytes read + written)")

    batch, context = setup.uniform
    uniform = DecodeCase.build(setup, [context] * batch, device)
    short, short_ctx, long, long_ctx = setup.mixed
    mixed = DecodeCase.build(setup, [short_ctx] * short + [long_ctx] * long, device)
    heads = f"{setup.num_heads} query / {setup.num_kv_heads} KV heads, head_dim {setup.head_dim}"
    print(f"decode attention, {heads}, {setup.dtype}, block size {BLOCK_SIZE}:")
    uniform_ms = uniform.time_ms(setup, DecodeConfig())
    for name, case, ms in (
        (f"{batch} x {context:,}", uniform, uniform_ms),
        (f"{short} x {short_ctx:,} + {long} x {long_ctx:,}", mixed, mixed.time_ms(setup)),
    ):
        share = case.kv_bytes / ms / 1e-3 / copy_bw
        print(
            f"  {name:<22} {case.kv_bytes / 1e6:8,.1f} MB K/V in {ms:7.3f} ms = "
            f"{fmt_bw(case.kv_bytes / ms / 1e-3)} = {share:5.1%} of copy "
            f"(goal >= 80%: {'met' if share >= 0.8 else 'missed'})"
        )
    dense = DenseDecode.of(uniform)
    error = relative_error(uniform.paged(), dense())
    dense_ms = time_ms(dense, device, setup)
    ratio = uniform_ms / dense_ms
    print(
        f"  paged / dense SDPA over contiguous K/V at {batch} x {context:,}: "
        f"{uniform_ms:.3f} / {dense_ms:.3f} ms = {ratio:.2f} (goal <= 1.1: "
        f"{'met' if ratio <= 1.1 else 'missed'}); relative error vs dense {error:.1e}"
    )
    print(f"  decode launch configurations at {batch} x {context:,} (default first):")
    for config in decode_configs(DecodeConfig()):
        ms = uniform.time_ms(setup, config)
        print(f"    {describe(config)}: {ms:.3f} ms = {fmt_bw(uniform.kv_bytes / ms / 1e-3)}")

    prompts, tokens = setup.prefill
    prefill = PrefillCase.build(setup, prompts, tokens, device)
    print(f"prefill attention, {prompts} prompts x {tokens:,} tokens, causal:")
    dense_ms = time_ms(prefill.dense, device, setup)
    for config in (PrefillConfig(), PrefillConfig(block_m=64, num_warps=4)):
        ms = time_ms(lambda c=config: prefill.paged(c), device, setup)
        print(
            f"  {describe(config)}: {ms:.3f} ms = {prefill.flops / ms / 1e9:.0f} TFLOP/s; "
            f"paged / dense causal SDPA {ms / dense_ms:.2f}; "
            f"relative error vs dense {relative_error(prefill.paged(config), prefill.dense()):.1e}"
        )


@dataclass
class DecodeCase:
    """One decode step's tensors: one query token per sequence over a paged cache."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_context_len: int
    kv_bytes: int  # K and V bytes the step must read

    @classmethod
    def build(cls, setup: Setup, context_lens: Sequence[int], device: torch.device) -> DecodeCase:
        """Random K/V; each sequence's blocks scattered over the pool, as after much churn."""
        query = randn(
            len(context_lens), setup.num_heads, setup.head_dim, setup=setup, device=device
        )
        k_cache, v_cache, block_tables = paged_cache(setup, context_lens, device)
        lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
        starts = torch.arange(len(context_lens) + 1, dtype=torch.int32, device=device)
        per_token = 2 * setup.num_kv_heads * setup.head_dim * k_cache.element_size()
        return cls(
            query,
            k_cache,
            v_cache,
            block_tables,
            lens,
            starts,
            max(context_lens),
            sum(context_lens) * per_token,
        )

    def paged(self, config: object | None = None) -> torch.Tensor:
        """The Triton decode kernel (``config`` a DecodeConfig, or the default)."""
        from pagedkv.attention.triton.attention import DecodeConfig, triton_paged_attention

        return triton_paged_attention(
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.context_lens,
            self.query_start_loc,
            1,
            self.max_context_len,
            self.query.shape[-1] ** -0.5,
            decode_config=config or DecodeConfig(),
        )

    def time_ms(self, setup: Setup, config: object | None = None) -> float:
        """Median ms per decode call."""
        return time_ms(lambda: self.paged(config), self.query.device, setup)


@dataclass
class DenseDecode:
    """The same decode step as SDPA over contiguous K/V: the bar paged decode is held to."""

    query: torch.Tensor  # [seqs, heads, 1, head_dim]
    key: torch.Tensor  # [seqs, kv_heads, context, head_dim]
    value: torch.Tensor

    @classmethod
    def of(cls, case: DecodeCase) -> DenseDecode:
        """Copy a case whose contexts are all equal out of its pages."""
        key, value = contiguous_kv(
            case.k_cache, case.v_cache, case.block_tables, case.max_context_len
        )
        return cls(case.query[:, :, None], key, value)

    def __call__(self) -> torch.Tensor:
        scale = self.query.shape[-1] ** -0.5
        out = F.scaled_dot_product_attention(
            self.query, self.key, self.value, enable_gqa=True, scale=scale
        )
        return out[:, :, 0]


@dataclass
class PrefillCase:
    """Whole prompts, no cached prefix: the paged prefill kernel against causal SDPA."""

    query: torch.Tensor  # [tokens, heads, head_dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    tokens: int
    dense_kv: tuple[torch.Tensor, torch.Tensor]
    flops: float

    @classmethod
    def build(cls, setup: Setup, prompts: int, tokens: int, device: torch.device) -> PrefillCase:
        """Random prompts already written to the cache, and their dense copies."""
        query = randn(prompts * tokens, setup.num_heads, setup.head_dim, setup=setup, device=device)
        k_cache, v_cache, block_tables = paged_cache(setup, [tokens] * prompts, device)
        lens = torch.full((prompts,), tokens, dtype=torch.int32, device=device)
        starts = torch.arange(0, prompts * tokens + 1, tokens, dtype=torch.int32, device=device)
        dense_kv = contiguous_kv(k_cache, v_cache, block_tables, tokens)
        flops = 2 * 2 * prompts * setup.num_heads * tokens * tokens * setup.head_dim / 2
        return cls(query, k_cache, v_cache, block_tables, lens, starts, tokens, dense_kv, flops)

    def paged(self, config: object) -> torch.Tensor:
        """The Triton prefill kernel with ``config`` (a PrefillConfig)."""
        from pagedkv.attention.triton.attention import triton_paged_attention

        return triton_paged_attention(
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.context_lens,
            self.query_start_loc,
            self.tokens,
            self.tokens,
            self.query.shape[-1] ** -0.5,
            prefill_config=config,
        )

    def dense(self) -> torch.Tensor:
        """Causal SDPA over contiguous K/V, laid out back as [tokens, heads, head_dim]."""
        prompts = self.block_tables.shape[0]
        query = self.query.view(prompts, self.tokens, *self.query.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(query, *self.dense_kv, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(self.query.shape)


def paged_cache(
    setup: Setup, context_lens: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V caches holding exactly these contexts, blocks in shuffled order, and block tables."""
    needed = [math.ceil(c / BLOCK_SIZE) for c in context_lens]
    shape = (sum(needed), BLOCK_SIZE, setup.num_kv_heads, setup.head_dim)
    k_cache = randn(*shape, setup=setup, device=device)
    v_cache = randn(*shape, setup=setup, device=device)
    order = torch.randperm(sum(needed), device=device, dtype=torch.int32)
    block_tables = torch.zeros(len(needed), max(needed), dtype=torch.int32, device=device)
    start = 0
    for seq, count in enumerate(needed):
        block_tables[seq, :count] = order[start : start + count]
        start += count
    return k_cache, v_cache, block_tables


def contiguous_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's first ``context`` keys and values as ``[seqs, kv_heads, context, dim]``."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    blocks = block_tables[:, : math.ceil(context / block_size)].long()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows = cache[blocks].flatten(1, 2)[:, :context]  # [seqs, context, kv_heads, dim]
        return rows.transpose(1, 2).contiguous()

    return gather(k_cache), gather(v_cache)


def decode_configs(default: object) -> list[object]:
    """The default decode configuration and a few neighbours worth timing on a new GPU."""
    return [
        default,
        replace(default, programs_per_sm=1),
        replace(default, programs_per_sm=3),
        replace(default, num_stages=3),
        replace(default, block_n=32),
        replace(default, block_n=128, num_warps=8),
        replace(default, partition_size=256),
        replace(default, partition_size=1024),
    ]


def copy_bandwidth(setup: Setup, device: torch.device) -> float:
    """Bytes read + written per second by one large device-to-device copy."""
    source = torch.empty(setup.copy_bytes, dtype=torch.uint8, device=device).random_()
    target = torch.empty_like(source)
    ms = time_ms(lambda: target.copy_(source), device, setup)
    return 2 * setup.copy_bytes / ms / 1e-3


def time_ms(fn: Callable[[], object], device: torch.device, setup: Setup) -> float:
    """Median milliseconds per call of ``fn``.

    On CUDA: warm up (compiles kernels), capture ``calls_per_graph`` calls in a CUDA graph and
    time its replays with CUDA events, so the figure is device time, not Python launch cost.
    On the CPU (dry run): wall time of one call.
    """
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(setup.calls_per_graph):
            fn()
    graph.replay()  # first replay uploads the graph
    times = []
    for _ in range(setup.replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / setup.calls_per_graph)
    return statistics.median(times)


# ----------------------------------------------------------------------------- engine


def run_engine(setup: Setup, device: torch.device) -> None:
    """pagedkv.LLM against transformers generate on one random Llama and one workload."""
    import transformers

    num_prompts, prompt_min, prompt_max, out_min, out_max = setup.workload
    rng = random.Random(0)
    vocab = setup.model["vocab_size"]

    def workload(n: int) -> tuple[list[list[int]], list[int]]:
        prompts = [
            [rng.randrange(3, vocab) for _ in range(rng.randint(prompt_min, prompt_max))]
            for _ in range(n)
        ]
        return prompts, [rng.randint(out_min, out_max) for _ in range(n)]

    prompts, outputs = workload(num_prompts)
    warmup_prompts, _ = workload(num_prompts)  # other prompts: no prefix-cache hits later
    with tempfile.TemporaryDirectory() as folder:
        model = random_llama(setup, device, Path(folder))
        params = sum(p.numel() for p in model.parameters())
        print(
            f"engine: random Llama, {params / 1e6:,.1f}M parameters, {setup.dtype}, "
            f"{num_prompts} prompts of {prompt_min}-{prompt_max} tokens, outputs "
            f"{out_min}-{out_max} ({sum(outputs):,} tokens), ignore_eos, greedy"
        )
        try:
            pagedkv_s = time_pagedkv(setup, device, Path(folder), prompts, outputs, warmup_prompts)
        except ImportError as error:
            print(f"  pagedkv.LLM: not available ({error})")
            pagedkv_s = None
    requested = sum(outputs)
    if pagedkv_s is not None:  # printed before transformers runs, which may take longer
        print(
            f"  pagedkv LLM.generate: {requested:,} tokens in {pagedkv_s:.2f} s = "
            f"{requested / pagedkv_s:,.0f} tokens/s; attention through "
            f"{'Triton' if 'pagedkv.attention.triton.attention' in sys.modules else 'PyTorch'}",
            flush=True,
        )
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf_s = time_transformers(model, device, prompts, outputs, warmup_prompts, transformers)
    hf_generated = len(prompts) * max(outputs)
    print(
        f"  transformers generate, one batch of {len(prompts)} x {max(outputs)} new tokens: "
        f"{hf_generated:,} tokens in {hf_s:.2f} s = {hf_generated / hf_s:,.0f} tokens/s; "
        f"the {requested:,} requested = {requested / hf_s:,.0f} tokens/s"
    )
    if pagedkv_s is not None:
        ratio = hf_s / pagedkv_s
        print(
            f"  pagedkv / transformers' requested tokens/s: {ratio:.2f}x "
            f"(goal >= 3x: {'met' if ratio >= 3 else 'missed'})"
        )


# A small float32 Llama for the agreement check: its output is compared, not timed.
AGREEMENT_MODEL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)


# Speculative decoding in the agreement check: prompt lookup, and the model as its own draft.
DRAFTS = {"num_speculative_tokens": 3}
NGRAM_CHECK = {"method": "ngram", "prompt_lookup_min": 1, **DRAFTS}
# Largest gap between transformers' top logit and the engine's greedy token, and between the
# two logprobs of that token, that still counts as agreeing (float32, different kernels).
AGREEMENT_LOGIT_GAP = 1e-3
AGREEMENT_LOGPROB_DIFF = 1e-3
# The fp8 cache rounds every K/V value to 3 mantissa bits: its tokens are checked by rank.
FP8_TOP_RANK = 5


def run_agreement(setup: Setup, device: torch.device) -> None:
    """The engine's greedy tokens and logprobs on `device` against transformers' logits."""
    from pagedkv import LLM, SamplingParams

    float_setup = replace(setup, dtype=torch.float32, model=setup.model | AGREEMENT_MODEL)
    rng = random.Random(1)
    vocab = float_setup.model["vocab_size"]
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = [
        (shared if index % 2 else []) + [rng.randrange(3, vocab) for _ in range(length)]
        for index, length in enumerate((5, 17, 33, 64, 100, 150, 9, 200))
    ]
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0, logprobs=1)
    with tempfile.TemporaryDirectory() as folder:
        model = random_llama(float_setup, device, Path(folder))
        runs = {
            "float32 KV": ("auto", None),
            "fp8 KV": ("fp8", None),
            "float32 KV, n-gram drafts": ("auto", NGRAM_CHECK),
            "float32 KV, the model drafting for itself": ("auto", {"model": folder, **DRAFTS}),
        }
        for label, (kv_cache_dtype, speculative_config) in runs.items():
            llm = LLM(
                model=folder,
                dtype="float32",
                device=device.type,
                kv_cache_dtype=kv_cache_dtype,
                num_gpu_blocks=256,
                max_num_batched_tokens=64,  # prompts run in chunks beside other decodes
                enable_prefix_caching=True,
                seed=0,
                speculative_config=speculative_config,
            )
            llm.generate(prompts[:2], params, use_tqdm=False)  # fills the prefix cache
            outputs = llm.generate(prompts, params, use_tqdm=False)
            gaps, diffs, ranks = [], [], []
            for prompt, output in zip(prompts, outputs, strict=True):
                sample = output.outputs[0]
                ids = torch.tensor([prompt + list(sample.token_ids)], device=device)
                with torch.inference_mode():
                    logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
                logprobs = torch.log_softmax(logits, dim=-1)
                for row, logprob_row, token_id, entry in zip(
                    logits, logprobs, sample.token_ids, sample.logprobs, strict=True
                ):
                    gaps.append(float(row.max() - row[token_id]))
                    ranks.append(int((row > row[token_id]).sum()) + 1)
                    diffs.append(abs(entry[token_id].logprob - float(logprob_row[token_id])))
            drafts = llm.engine.stats.spec_decoding
            del llm
            gc.collect()
            total = len(gaps)
            if kv_cache_dtype == "auto":
                agreeing = sum(gap <= AGREEMENT_LOGIT_GAP for gap in gaps)
                met = agreeing == total and max(diffs) <= AGREEMENT_LOGPROB_DIFF
                kept = f", {drafts.num_accepted_tokens} drafts kept" if speculative_config else ""
                print(
                    f"agreement, {label}: {agreeing}/{total} greedy tokens are transformers' "
                    f"argmax (gap <= {AGREEMENT_LOGIT_GAP}), largest logprob difference "
                    f"{max(diffs):.2e}{kept} (goal: all, <= {AGREEMENT_LOGPROB_DIFF}: "
                    f"{'met' if met else 'missed'})"
                )
            else:
                within = sum(rank <= FP8_TOP_RANK for rank in ranks)
                top1 = sum(rank == 1 for rank in ranks)
                print(
                    f"agreement, {label}: {top1}/{total} greedy tokens are transformers' argmax, "
                    f"{within}/{total} in its top {FP8_TOP_RANK} (goal: all in the top "
                    f"{FP8_TOP_RANK}: {'met' if within == total else 'missed'})"
                )


def run_lora_agreement(setup: Setup, device: torch.device) -> None:
    """LoRA on the device: 3 random adapters of rank 8 and base requests in one batch; each
    request's greedy tokens against transformers' logits with its adapter merged into the
    weights (W += scaling * B A), teacher-forced."""
    from safetensors.torch import load_file

    from pagedkv import LLM, LoRARequest, SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lora_bench import write_adapter

    float_setup = replace(setup, dtype=torch.float32, model=setup.model | AGREEMENT_MODEL)
    rng = random.Random(2)
    vocab = float_setup.model["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 40, 17, 64, 9, 33, 100, 3)]
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    with tempfile.TemporaryDirectory() as folder:
        model = random_llama(float_setup, device, Path(folder) / "model")
        llm = LLM(
            model=str(Path(folder) / "model"),
            dtype="float32",
            device=device.type,
            num_gpu_blocks=512,
            enable_lora=True,
            max_loras=3,
        )
        config = llm.engine.config
        loras = [
            LoRARequest(f"a{i}", i + 1, str(write_adapter(Path(folder) / f"a{i}", config, 8, i)))
            for i in range(3)
        ]
        chosen = [loras[i % 4] if i % 4 < 3 else None for i in range(len(prompts))]
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=chosen)
        base = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        gaps = []
        for prompt, lora, output in zip(prompts, chosen, outputs, strict=True):
            merged = dict(base)
            if lora is not None:
                settings = json.loads((Path(lora.lora_path) / "adapter_config.json").read_text())
                scaling = settings["lora_alpha"] / settings["r"]
                tensors = load_file(Path(lora.lora_path) / "adapter_model.safetensors")
                for key, a in tensors.items():
                    if ".lora_A." in key:
                        b = tensors[key.replace(".lora_A.", ".lora_B.")]
                        name = key.removeprefix("base_model.model.").replace(".lora_A", "")
                        merged[name] = base[name] + scaling * (b.to(device) @ a.to(device))
            model.load_state_dict(merged)
            tokens = list(output.outputs[0].token_ids)
            with torch.inference_mode():
                ids = torch.tensor([prompt + tokens], device=device)
                logits = model(ids).logits[0, len(prompt) - 1 : -1]
            gaps += [float(row.max() - row[t]) for row, t in zip(logits, tokens, strict=True)]
        agreeing = sum(gap <= AGREEMENT_LOGIT_GAP for gap in gaps)
        print(
            f"agreement, 3 LoRA adapters and base requests in one batch: {agreeing}/{len(gaps)} "
            f"greedy tokens are transformers' argmax with the adapter merged (gap <= "
            f"{AGREEMENT_LOGIT_GAP}; goal: all: {'met' if agreeing == len(gaps) else 'missed'})"
        )


def random_llama(setup: Setup, device: torch.device, folder: Path):
    """Save a seeded random Llama (and a word-level tokenizer over its vocabulary) to folder."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    transformers.set_seed(0)
    config = transformers.LlamaConfig(
        **setup.model, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2
    )
    with device:
        model = transformers.LlamaForCausalLM(config).to(setup.dtype).eval()
    model.save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(special))
    return model


def time_pagedkv(
    setup: Setup,
    device: torch.device,
    folder: Path,
    prompts: list[list[int]],
    outputs: list[int],
    warmup_prompts: list[list[int]],
) -> float:
    """Seconds for `LLM.generate` over the workload, after a short warm-up run."""
    from pagedkv import LLM, SamplingParams

    dtype = str(setup.dtype).removeprefix("torch.")
    extra = {"gpu_memory_utilization": 0.5} if device.type == "cuda" else {"num_gpu_blocks": 512}
    llm = LLM(model=str(folder), dtype=dtype, device=device.type, seed=0, **extra)

    def params(max_tokens: int) -> object:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)

    # Compiles the kernels' variants: prefill, decode in one partition and split.
    llm.generate(warmup_prompts, params(4), use_tqdm=False)
    llm.generate([warmup_prompts[0] * 4], params(2), use_tqdm=False)
    seconds = timed(
        lambda: llm.generate(prompts, [params(n) for n in outputs], use_tqdm=False), device
    )
    return seconds


def time_transformers(
    model,
    device: torch.device,
    prompts: list[list[int]],
    outputs: list[int],
    warmup_prompts: list[list[int]],
    transformers,
) -> float:
    """Seconds for one batched, left-padded `generate` of max(outputs) tokens per prompt."""

    def generate(batch: list[list[int]], new_tokens: int) -> None:
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # ignore_eos: every row runs to the end
            do_sample=False,
            pad_token_id=0,
        )

    with torch.inference_mode():
        generate(warmup_prompts, 4)
        return timed(lambda: generate(prompts, max(outputs)), device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn`` takes, by CUDA events around it on CUDA, by the wall clock on the CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


# ---------------------------------------------------------------------------- helpers


def randn(*shape: int, setup: Setup, device: torch.device) -> torch.Tensor:
    """Standard normal values in the setup's dtype (never zeros: they can time faster)."""
    return torch.randn(*shape, device=device, dtype=torch.float32).to(setup.dtype)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """``|out - expected| / |expected|`` in float64 (Frobenius norms)."""
    out, expected = out.double(), expected.double()
    return float((out - expected).norm() / expected.norm())


def describe(config: object) -> str:
    """A launch configuration as ``name=value`` pairs."""
    return " ".join(f"{name}={value}" for name, value in asdict(config).items())


def fmt_bw(bytes_per_s: float) -> str:
    """Bandwidth in TB/s (10^12 bytes), or GB/s below one TB/s."""
    if bytes_per_s >= 1e12:
        return f"{bytes_per_s / 1e12:.2f} TB/s"
    return f"{bytes_per_s / 1e9:.2f} GB/s"


if __name__ == "__main__":
    main()
