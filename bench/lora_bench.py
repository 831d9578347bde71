"""Multi-LoRA throughput against the base model, in one run, and the cost of an adapter.

Why: serving many fine-tunes of one base model is only worth it if a batch mixing adapters
runs nearly as fast as the base model alone. This runs the same 32 prompts twice per round,
rounds alternating (this machine is shared): once as base-model requests, once spread over 8
adapters of rank 16 (4 requests each, every projection adapted), and prints both throughputs
and their ratio (the goal: >= 0.8x). It also times bringing an adapter in: reading and checking
its PEFT folder (the first request naming it), and writing it into its blocks of the KV pool
(when it is loaded for a step), and says how many blocks an adapter takes.

The adapters are random (seeded), written as PEFT folders (`adapter_config.json` and
`adapter_model.safetensors`, PEFT's tensor names) for the built-in model's shapes.

Run: `python bench/lora_bench.py`; quick: `--num-prompts 8 --max-tokens 16 --rounds 1`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
from safetensors.torch import save_file

from pagedkv.bench.main import positive_int
from pagedkv.bench.workloads import WorkloadSpec, make_workload
from pagedkv.kvmath.lora import TARGETS
from pagedkv.worker.threads import physical_cores

DEFAULT_MODEL = "smollm2-135m-instruct"


def write_adapter(folder: Path, config, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of `rank` on every projection of `config`'s model."""
    from pagedkv.weights.lora import projection_shapes

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target, (in_features, out_features) in projection_shapes(config).items():
            block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, in_features, generator=generator) / in_features**0.5
            )
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(out_features, rank, generator=generator) * 0.02
            )
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from pagedkv import LLM, LoRARequest, SamplingParams
    from pagedkv.worker import lora_slots

    llm = LLM(
        model=args.model,
        threads=args.threads,
        enable_lora=True,
        max_loras=args.num_adapters,
        max_lora_rank=args.rank,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    spec = WorkloadSpec(args.num_prompts, (32, 256), (args.max_tokens, args.max_tokens))
    prompts = make_workload("lora", spec, engine.config.vocab_size, args.seed).prompts
    requests = [{"prompt_token_ids": prompt} for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    write_seconds: list[float] = []
    original_write = lora_slots.write_adapter

    def timed_write(*write_args):
        started = time.perf_counter()
        try:
            return original_write(*write_args)
        finally:
            write_seconds.append(time.perf_counter() - started)

    lora_slots.write_adapter = timed_write
    with TemporaryDirectory() as root:
        loras, read_seconds = [], []
        for index in range(args.num_adapters):
            folder = write_adapter(Path(root) / f"a{index}", engine.config, args.rank, index)
            lora = LoRARequest(f"adapter-{index}", index + 1, str(folder))
            started = time.perf_counter()
            engine.loras.resolve(lora)
            read_seconds.append(time.perf_counter() - started)
            loras.append(lora)
        chosen = [loras[i % len(loras)] for i in range(len(prompts))]
        llm.generate(requests[:2], params, use_tqdm=False)  # warm-up, base
        llm.generate(requests[:2], params, use_tqdm=False, lora_request=chosen[:2])
        print(
            f"{args.num_prompts} prompts of 32-256 tokens, {args.max_tokens} new each, greedy; "
            f"{args.num_adapters} adapters of rank {args.rank} on every projection, "
            f"{args.threads} threads; load average (1 min) before "
            f"{Path('/proc/loadavg').read_text().split()[0]}"
        )
        rates: dict[str, list[float]] = {"base": [], "lora": []}
        for round_index in range(args.rounds):
            for name in ("base", "lora"):
                started = time.perf_counter()
                outputs = llm.generate(
                    requests,
                    params,
                    use_tqdm=False,
                    lora_request=chosen if name == "lora" else None,
                )
                seconds = time.perf_counter() - started
                tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
                rates[name].append(tokens / seconds)
                print(
                    f"  round {round_index + 1} {name:5} {tokens} tokens in {seconds:6.2f} s = "
                    f"{tokens / seconds:6.1f} tok/s"
                )
    base, lora = max(rates["base"]), max(rates["lora"])
    blocks = engine.loras.num_blocks[1]
    block_bytes = engine.kv_bytes_per_block
    print(f"base {base:.1f} tok/s, {args.num_adapters} adapters {lora:.1f} tok/s (best rounds)")
    print(f"adapters / base: {lora / base:.2f}x (goal >= 0.8x)")
    print(
        f"an adapter: {blocks} KV blocks ({blocks * block_bytes / 2**20:.1f} MiB of the pool); "
        f"read and checked in {1e3 * min(read_seconds):.1f} ms (first request), written into "
        f"its blocks in {1e3 * min(write_seconds):.1f} ms (when loaded); "
        f"{engine.adapters.num_loads} loads, {engine.adapters.num_evictions} evictions; load "
        f"average after {Path('/proc/loadavg').read_text().split()[0]}"
    )
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lora_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, folder or .gguf")
    parser.add_argument("--num-prompts", type=positive_int, default=32, help="requests a round")
    parser.add_argument("--max-tokens", type=positive_int, default=128, help="new tokens each")
    parser.add_argument("--num-adapters", type=positive_int, default=8, help="LoRA adapters")
    parser.add_argument("--rank", type=positive_int, default=16, help="their rank")
    parser.add_argument("--rounds", type=positive_int, default=2, help="alternating rounds")
    parser.add_argument("--seed", type=int, default=0, help="prompts' seed")
    parser.add_argument(
        "--threads", type=positive_int, default=physical_cores(), help="CPU threads"
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
