"""`pagedkv plan`: KV bytes per token, per request and per GPU pool, and concurrency per length.

Imports nothing heavy (no torch, no numpy) so that it answers instantly.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from pagedkv.commands.arguments import (
    non_negative_gb,
    positive_fraction,
    positive_gb,
    positive_int,
    token_counts,
)
from pagedkv.commands.planning_model import (
    add_device_argument,
    add_hub_arguments,
    add_kv_dtype_arguments,
    device_note,
    family_note,
    kv_dtype_of,
    on_device,
    resolve_planning_model,
)
from pagedkv.kvmath.capacity import CapacityPlan, PoolBudget, plan_capacity
from pagedkv.kvmath.lora import LoRAPlan, plan_lora
from pagedkv.kvmath.parallel import check_even_split, per_rank_spec
from pagedkv.kvmath.presets import GPU_PRESETS, MODEL_PRESETS, Model, gpu_preset
from pagedkv.kvmath.spec import (
    GB,
    ConfigError,
    KVSpec,
    format_bytes,
)

DEFAULT_LENGTHS = "2k,8k,32k,128k"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_ACTIVATION_GB = 2.0
# The terms of `memory x utilization - weights - activations`: they size a pool from --gpu,
# and mean nothing beside a pool given directly.
GPU_TERMS = ("gpu_memory_utilization", "weights_gb", "activation_gb")
DEFAULT_MAX_NUM_SEQS = 256  # the engine's and vLLM's default (a test checks EngineArgs')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare `pagedkv plan`'s options."""
    parser.add_argument(
        "--model",
        required=True,
        help=f"preset ({', '.join(MODEL_PRESETS)}), a config.json, a model folder, a .gguf file "
        "or a Hugging Face repo id in the local cache",
    )
    add_hub_arguments(parser)
    add_kv_dtype_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per block")
    pool = parser.add_mutually_exclusive_group(required=True)
    pool.add_argument("--pool-gb", type=positive_gb, help="KV pool size in GB (10^9 bytes)")
    pool.add_argument("--gpu", help=f"size the pool from a GPU: {', '.join(GPU_PRESETS)}")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=positive_fraction,
        help="with --gpu: fraction of GPU memory the server may use "
        f"(default {DEFAULT_GPU_MEMORY_UTILIZATION})",
    )
    parser.add_argument(
        "--activation-gb",
        type=non_negative_gb,
        help="with --gpu: reserve for activations, CUDA graphs and allocator slack, GB "
        f"(default {DEFAULT_ACTIVATION_GB:g}; vLLM measures it by profiling: pass what your "
        "server logs)",
    )
    parser.add_argument(
        "--weights-gb",
        type=positive_gb,
        help="with --gpu: weight memory in GB (10^9 bytes) of all ranks together, overriding "
        "the model's (vLLM's log gives one rank's, in GiB: times the ranks, times 1.074)",
    )
    parser.add_argument(
        "--lengths",
        type=token_counts,
        default=token_counts(DEFAULT_LENGTHS),
        help=f"request lengths to tabulate, k = 1024 (default {DEFAULT_LENGTHS})",
    )
    parser.add_argument(
        "--avg-tokens",
        type=positive_int,
        help="compare slab reservation at --max-model-len with paging for requests this long",
    )
    parser.add_argument(
        "--max-model-len", type=positive_int, help="context a slab reserves (default: the model's)"
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="ranks the KV heads (and, with --gpu, the weights) are split across: figures are "
        "per rank, whose pool holds the same blocks as every other rank's (default: 1)",
    )
    parser.add_argument(
        "--lora-rank",
        type=positive_int,
        help="serve LoRA adapters of this rank on every projection: their blocks are taken "
        "from the pool before it is shared out (the engine pages them into the KV pool)",
    )
    parser.add_argument(
        "--max-loras",
        type=positive_int,
        help="with --lora-rank: adapters resident at once (default: 1)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run(args: argparse.Namespace) -> int:
    """Plan capacity and print it; a bad model, GPU or number is a one-line error, exit 2."""
    try:
        kv_dtype = kv_dtype_of(args)
        device = _device(args)
        model = resolve_planning_model(args.model, kv_dtype, args.revision, args.download_dir)
        notes = [
            note
            for note in (device_note(model, device, kv_dtype is not None), family_note(model))
            if note
        ]
        model = on_device(model, device, kv_dtype_given=kv_dtype is not None)
        if args.weights_gb is not None:
            given = round(args.weights_gb * GB)
            model = replace(model, weight_bytes=given, weight_source="--weights-gb")
        spec = per_rank_spec(model.spec, args.tensor_parallel_size)
        check_even_split(model.config, args.tensor_parallel_size)
        pool = _pool(args, model)
        lora = _lora(args, model, spec)
        if lora is not None:
            if lora.pool_bytes >= pool.pool_bytes:
                raise ConfigError(
                    f"{lora.max_loras} LoRA adapter{'s' if lora.max_loras > 1 else ''} of rank "
                    f"{lora.rank} take{'' if lora.max_loras > 1 else 's'} "
                    f"{format_bytes(lora.pool_bytes)}, the whole KV pool is "
                    f"{format_bytes(pool.pool_bytes)}"
                )
            pool = replace(pool, pool_bytes=pool.pool_bytes - lora.pool_bytes)
        plan = plan_capacity(
            spec,
            pool,
            args.lengths,
            block_size=args.block_size,
            avg_tokens=args.avg_tokens,
            max_model_len=args.max_model_len,
        )
    except ConfigError as exc:
        print(f"pagedkv plan: error: {exc}", file=sys.stderr)
        return 2
    ranks = _ranks(model, args.tensor_parallel_size)
    adapters = {} if lora is None else lora.to_dict()
    if args.json:
        figures = {"model": model.name, "notes": notes, **ranks, **adapters, **plan.to_dict()}
        print(json.dumps(figures, indent=2))
    else:
        _print_plan(Console(), model, plan, ranks, lora, notes)
    return 0


def _device(args: argparse.Namespace) -> str | None:
    """The device sized: `--device`, else a GPU's with `--gpu`, else None (the checkpoint's
    dtype)."""
    if args.gpu is None:
        return args.device
    if args.device == "cpu":
        raise ConfigError(f"--gpu {args.gpu} sizes a GPU's pool; --device cpu contradicts it")
    return "cuda"


def _lora(args: argparse.Namespace, model: Model, spec: KVSpec) -> LoRAPlan | None:
    """The adapters' share of the pool with --lora-rank, else None."""
    if args.lora_rank is None:
        if args.max_loras is not None:
            raise ConfigError("--max-loras needs --lora-rank (the adapters' rank)")
        return None
    config = model.config or {}
    if not spec.num_kv_heads or not {"hidden_size", "intermediate_size"} <= set(config):
        raise ConfigError(f"--lora-rank needs a Llama-style model config; {model.name} is not")
    return plan_lora(
        config,
        spec,
        args.lora_rank,
        args.max_loras or 1,
        args.block_size,
        args.tensor_parallel_size,
    )


def _ranks(model: Model, tensor_parallel_size: int) -> dict[str, int]:
    """What tensor parallelism changes: KV heads and bytes per token on one rank and all."""
    spec = per_rank_spec(model.spec, tensor_parallel_size)
    return {
        "tensor_parallel_size": tensor_parallel_size,
        "kv_heads_per_rank": spec.num_kv_heads,
        "bytes_per_token_per_rank": spec.bytes_per_token,
        "bytes_per_token_all_ranks": spec.bytes_per_token * tensor_parallel_size,
    }


def _pool(args: argparse.Namespace, model: Model) -> PoolBudget:
    if args.pool_gb is not None:
        given = [term for term in GPU_TERMS if getattr(args, term) is not None]
        if given:
            options = " and ".join("--" + term.replace("_", "-") for term in given)
            verb = "applies" if len(given) == 1 else "apply"
            raise ConfigError(
                f"{options} {verb} only with --gpu, to size the pool from a GPU; "
                f"--pool-gb {args.pool_gb:g} gives the pool directly"
            )
        return PoolBudget.given(round(args.pool_gb * GB))
    gpu = gpu_preset(args.gpu)
    weight_bytes = model.weight_bytes
    if weight_bytes is None:
        raise ConfigError(
            f"cannot size the weights of {model.name} ({model.weight_source}); give --weights-gb"
        )
    weight_bytes //= args.tensor_parallel_size  # each rank's share (norms aside)
    return PoolBudget.from_gpu(
        gpu.name,
        gpu.memory_bytes,
        _default(args.gpu_memory_utilization, DEFAULT_GPU_MEMORY_UTILIZATION),
        weight_bytes,
        round(_default(args.activation_gb, DEFAULT_ACTIVATION_GB) * GB),
    )


def _default(value: float | None, default: float) -> float:
    return default if value is None else value


def _print_plan(
    console: Console,
    model: Model,
    plan: CapacityPlan,
    ranks: dict[str, int],
    lora: LoRAPlan | None,
    notes: list[str],
) -> None:
    spec = plan.spec
    per_rank = " on each rank" if ranks["tensor_parallel_size"] > 1 else ""
    console.print(
        f"[bold]{model.name}[/]: {spec.bytes_per_token:,} B of KV per token{per_rank} "
        f"= {format_bytes(spec.bytes_per_token)}"
    )
    console.print(f"  = {spec.formula()}")
    if per_rank:
        # A latent (MLA) cache has no KV heads: every rank holds the whole latent.
        heads = (
            f"{ranks['kv_heads_per_rank']} of {model.spec.num_kv_heads} KV heads per rank"
            if model.spec.num_kv_heads
            else "the whole latent KV on every rank"
        )
        console.print(
            f"  tensor parallel over {ranks['tensor_parallel_size']} ranks: {heads}, "
            f"{ranks['bytes_per_token_all_ranks']:,} B per token on all ranks together; the "
            "pool and capacity below are one rank's, and every rank holds the same blocks"
        )
    if spec.max_model_len:
        served = plan.context if plan.context != spec.max_model_len else None
        console.print(
            f"  context {spec.max_model_len:,} tokens"
            + (f", {served:,} served (--max-model-len)" if served else "")
        )
    for note in notes:
        console.print(f"  note: {note}", soft_wrap=True)
    if spec.sliding_window:
        console.print(
            f"  sliding window {spec.sliding_window:,} tokens: pagedkv keeps every token's "
            "blocks, as these figures do (a server that frees the blocks behind the window "
            f"holds about {spec.sliding_window:,} tokens a request: the window and the "
            "tokens of one step, in whole blocks)"
        )
    console.print()
    adapter_bytes = 0 if lora is None else lora.pool_bytes
    if plan.pool.gpu is not None:
        console.print(_pool_table(model, plan.pool, ranks["tensor_parallel_size"], adapter_bytes))
    else:
        console.print(f"KV pool {format_bytes(plan.pool.pool_bytes + adapter_bytes)}, given")
    if lora is not None:
        console.print(
            f"  LoRA: {lora.max_loras} adapter{'s' if lora.max_loras > 1 else ''} of rank "
            f"{lora.rank} on every projection, {format_bytes(lora.bytes_per_adapter)} of float32 "
            f"each{per_rank} = {lora.blocks_per_adapter:,} blocks; {lora.blocks:,} blocks "
            f"({format_bytes(lora.pool_bytes)}) when all are resident, the rest for KV:"
        )
    console.print(
        f"  = {plan.pool_tokens:,} tokens, in {plan.pool_blocks:,} whole blocks of "
        f"{plan.block_size} tokens ({plan.pool_blocks * plan.block_size:,} tokens)\n"
        f"  one block: {format_bytes(spec.bytes_per_block(plan.block_size))}"
    )
    console.print(f"  longest single request: {plan.longest_request:,} tokens")
    console.print()
    console.print(_lengths_table(plan))
    if plan.comparison is not None:
        console.print()
        console.print(_comparison_table(plan))


def _pool_table(
    model: Model, pool: PoolBudget, tensor_parallel_size: int, adapter_bytes: int = 0
) -> Table:
    table = Table(
        title=f"KV pool on {pool.gpu} ({GPU_PRESETS[pool.gpu].product})", title_justify="left"
    )
    table.add_column("term")
    table.add_column("GB", justify="right")
    table.add_column("GiB", justify="right")
    table.add_column("from")
    usable = int(pool.memory_bytes * pool.utilization)
    for term, value, source in (
        ("GPU memory", pool.memory_bytes, f"{GPU_PRESETS[pool.gpu].memory_mib:,} MiB (nvidia-smi)"),
        (f"x utilization {pool.utilization:g}", usable, ""),
        ("- weights", pool.weight_bytes, _weight_source(model, tensor_parallel_size)),
        ("- activation reserve", pool.activation_bytes, "--activation-gb"),
        *(
            [("- LoRA adapters", adapter_bytes, "--lora-rank, --max-loras")]
            if adapter_bytes
            else []
        ),
        ("= KV pool", pool.pool_bytes, ""),
    ):
        table.add_row(term, f"{value / GB:,.2f}", f"{value / 2**30:,.2f}", source)
    return table


def _weight_source(model: Model, tensor_parallel_size: int) -> str:
    if tensor_parallel_size == 1:
        return model.weight_source
    return f"{model.weight_source}, / {tensor_parallel_size} ranks"


def _lengths_table(plan: CapacityPlan) -> Table:
    table = Table(title="Concurrency per request length", title_justify="left")
    table.add_column("request tokens", justify="right")
    table.add_column("KV per request", justify="right", no_wrap=True)
    table.add_column("blocks", justify="right")
    table.add_column("max concurrent", justify="right")
    notes = set()
    for row in plan.rows:
        length = f"{row.request_tokens:,}"
        if row.beyond_context:
            length += " *"
            notes.add(f"* beyond the {plan.context:,}-token context served (max_model_len)")
        concurrent = f"{row.max_concurrency:,}"
        if row.max_concurrency > DEFAULT_MAX_NUM_SEQS:
            concurrent += " s"
            notes.add(
                f"s the memory's figure: a step runs at most max_num_seqs sequences "
                f"({DEFAULT_MAX_NUM_SEQS} by default), the others wait their turn"
            )
        table.add_row(
            length, format_bytes(row.bytes_per_request), f"{row.blocks_per_request:,}", concurrent
        )
    if notes:
        table.caption = "; ".join(sorted(notes))
    return table


def _comparison_table(plan: CapacityPlan) -> Table:
    comparison = plan.comparison
    bytes_per_token = plan.spec.bytes_per_token
    table = Table(
        title=f"Requests averaging {comparison.avg_tokens:,} tokens, "
        f"max_model_len {comparison.max_model_len:,}",
        title_justify="left",
        caption=(
            f"paging fits {comparison.gain:,.1f}x as many requests"
            if comparison.slab_concurrency
            else f"a slab of {comparison.max_model_len:,} tokens does not fit the pool"
        ),
    )
    table.add_column("scheme, tokens held")
    table.add_column("KV per request", justify="right", no_wrap=True)
    table.add_column("max concurrent", justify="right")
    slab_tokens = comparison.slab_tokens_per_request
    paged_tokens = comparison.paged_blocks_per_request * plan.block_size
    table.add_row(
        f"slab: {slab_tokens:,} reserved",
        format_bytes(slab_tokens * bytes_per_token),
        f"{comparison.slab_concurrency:,}",
    )
    table.add_row(
        f"paged: {comparison.paged_blocks_per_request:,} blocks = {paged_tokens:,}",
        format_bytes(paged_tokens * bytes_per_token),
        f"{comparison.paged_concurrency:,}",
    )
    return table
