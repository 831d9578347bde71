"""What each EngineArgs field means, as `--help` prints it for its flag, and how a flag's
token count is read (`human_readable_int`, vLLM's `32k`).

Kept apart from `args.py` so the dataclass and its checks read on one screen;
`EngineArgs.add_cli_args` looks every field up here, so a field without its line fails every
command's parser.
"""

import argparse
import re

FIELD_HELP = {
    "model": "Hugging Face folder, .gguf file, built-in model name, or a Hugging Face repo id "
    "(or vLLM's REPO_ID:QUANT_TYPE of a GGUF file) already in the local Hugging Face cache",
    "block_size": "tokens per KV block",
    "num_gpu_blocks": "KV blocks in the pool (default: sized from free memory)",
    "num_gpu_blocks_override": "vLLM's name for num_gpu_blocks (wins when given)",
    "kv_cache_memory": "bytes for the KV pool, instead of num_gpu_blocks",
    "kv_cache_memory_bytes": "vLLM's name for kv_cache_memory (wins when given)",
    "kv_cache_dtype": "what KV blocks store: auto (the model's dtype) or one byte per value, "
    "fp8 (= fp8_e4m3: finer steps) or fp8_e5m2 (wider range); fp8 holds 2x the blocks of "
    "a 16-bit cache, 4x of float32",
    "swap_space_gb": "GiB of CPU memory for swapped-out blocks (0 disables swap)",
    "swap_space": "vLLM's name for swap_space_gb (wins when given)",
    "enable_prefix_caching": "reuse KV blocks of identical prompt prefixes",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step, prefill chunks and decodes together",
    "max_model_len": "longest prompt + output (default: the model's context length)",
    "preemption_mode": "swap or recompute (default: swap when swap space is configured)",
    "scheduling_policy": "fcfs (arrival order) or priority (a request's priority, lower first)",
    "dtype": "weights, activations and KV dtype (auto: float32 on CPU, bfloat16 on GPU)",
    "device": "cpu or cuda",
    "seed": "seed of the sampler for requests without their own seed",
    "gpu_memory_utilization": "share of GPU memory the engine may use (weights + KV); on the "
    "CPU the pool takes half the available memory, at most 4 GiB, unless num_gpu_blocks or "
    "kv_cache_memory sizes it",
    "max_logprobs": "most logprobs one request may ask for per token (-1: no cap)",
    "quantization": "weights kept as: auto (a GGUF file's own blocks; a float checkpoint "
    "stays float), none (all float), int8 or int4 (quantised on load; CPU only)",
    "threads": (
        "the most CPU threads for the model, one fewer while other work holds the cores "
        "(default: this machine's physical cores)"
    ),
    "tensor_parallel_size": "processes (one GPU each on CUDA) the model and the KV pool are "
    "split across, Megatron-style; the others are spawned here, or started by `pagedkv worker` "
    "under torchrun's environment",
    "pipeline_parallel_size": "accepted as vLLM's when 1: models are split by "
    "--tensor-parallel-size only",
    "data_parallel_size": "accepted as vLLM's when 1: one engine per server",
    "kv_offloading_size": "GiB of host RAM for a second tier of the prefix cache: blocks the "
    "KV pool evicts are kept there and copied back on a hit instead of recomputed (0: off)",
    "speculative_config": "speculative decoding, as vLLM's JSON: "
    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}\' (prompt lookup) or \'{"model": PATH_OR_NAME, '
    '"num_speculative_tokens": 4}\' (a draft model with the same vocabulary); greedy output '
    "is unchanged, bit for bit",
    "enable_lora": "serve LoRA adapters (PEFT folders) per request; their weights are paged "
    "into the KV pool's blocks while requests use them",
    "max_loras": "most LoRA adapters resident in the pool at once (with enable_lora)",
    "max_cpu_loras": "most LoRA adapters whose weights are kept in host memory (default: "
    "max_loras); the least recently used idle one is forgotten first, and read again when a "
    "request names it",
    "max_lora_rank": "largest LoRA rank accepted (with enable_lora)",
    "tokenizer": "Hugging Face folder, .gguf file, built-in name or cached repo id whose "
    "tokenizer to use "
    "(default: the model's own); its ids must fit the model's vocabulary",
    "trust_remote_code": "accepted as vLLM's, to no effect: pagedkv never runs code that comes "
    "with a model; its architectures are its own registry's",
    "enforce_eager": "accepted as vLLM's, to no effect: pagedkv always runs steps eagerly (it "
    "captures no CUDA graphs)",
    "enable_chunked_prefill": "accepted as vLLM's, to no effect: prompts are always cut into "
    "chunks of max_num_batched_tokens (each request's output is the same either way)",
    "disable_log_stats": "accepted as vLLM's, to no effect: the engine logs no periodic stats "
    "(the server's /metrics has them)",
    "generation_config": "where default sampling settings come from: auto (the model folder's "
    "generation_config.json, as vLLM reads it), vllm (none), or a folder holding one",
    "override_generation_config": "default sampling settings over the generation config's, "
    'as JSON (vLLM\'s; e.g. \'{"temperature": 0.5, "max_new_tokens": 256}\')',
    "hf_overrides": 'config.json keys to replace, as JSON (e.g. \'{"max_position_embeddings": '
    "4096}'); a GGUF file's metadata is read as the same keys",
    "download_dir": "folder built-in models are pulled into and read from (default: the "
    "cache, $PAGEDKV_CACHE or ~/.cache/pagedkv), and the Hugging Face cache repo ids are read "
    "from (default: huggingface_hub's, $HF_HUB_CACHE or $HF_HOME/hub or "
    "~/.cache/huggingface/hub)",
    "load_format": "what the model's weights are read from: auto (by the path), safetensors "
    "(a Hugging Face folder) or gguf (a .gguf file); a model of another format is refused",
    "tokenizer_mode": "auto or hf, as vLLM's; both read tokenizer.json with the tokenizers library",
    "revision": "branch, tag or commit of a model named by a Hugging Face repo id, read from "
    "the local Hugging Face cache (default: main; pagedkv downloads nothing)",
    "tokenizer_revision": "the same for the tokenizer (default: revision)",
    "cpu_offload_gb": "accepted as vLLM's when 0: the weights stay on the device",
    "profiler_config": "vLLM's, as JSON: "
    '\'{"profiler": "torch", "torch_profiler_dir": DIR}\' '
    "lets start_profile / stop_profile (the server's POST /start_profile, /stop_profile) write "
    "a torch.profiler trace of the steps between, each step's stages marked",
    "compilation_config": "accepted as vLLM's (a level or JSON), to no effect: pagedkv "
    "compiles no graphs",
    "structured_outputs_config": "vLLM's, as JSON: backend (outputs are held by llguidance, "
    "vLLM's 'guidance', whichever is named) and its switches, which change nothing here",
    "logprobs_mode": "vLLM's; raw_logprobs only: logprobs are the model's own, before "
    "penalties, temperature and top-k/top-p",
    "guided_decoding_backend": "vLLM's older name of structured_outputs_config's backend",
    "task": "accepted as vLLM's when auto or generate: pagedkv runs generative models",
    "runner": "accepted as vLLM's when auto or generate: pagedkv runs generative models",
    "model_impl": "accepted as vLLM's when auto or vllm: each family runs pagedkv's own "
    "implementation",
    "distributed_executor_backend": "accepted as vLLM's when mp (or uni at one rank): "
    "tensor-parallel ranks are processes on this machine, or started by `pagedkv worker` "
    "under torchrun",
    "disable_custom_all_reduce": "accepted as vLLM's, to no effect: the ranks all-reduce "
    "through torch.distributed",
    "max_seq_len_to_capture": "accepted as vLLM's, to no effect: pagedkv captures no CUDA graphs",
    "async_scheduling": "accepted as vLLM's, to no effect on outputs: each step is scheduled "
    "after the last one's tokens are known",
    "skip_tokenizer_init": "accepted as vLLM's when off: the engine detokenizes its outputs "
    "(and stop strings need the text)",
    "enable_sleep_mode": "accepted as vLLM's when off: the engine keeps its weights and KV pool "
    "until it is shut down",
    "hf_token": "accepted as vLLM's, to no effect: pagedkv fetches nothing from the Hugging "
    "Face Hub",
}


def human_readable_int(text: str) -> int:
    """vLLM's token counts on the command line: `32768`, or with a suffix, decimal in lower
    case (`25.6k` is 25,600) and binary in upper case (`32K` is 32,768, whole numbers only)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r} (e.g. 32768, 32k, 32K)")
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a decimal takes a decimal suffix (k, m, g, t), not {suffix!r}"
        )
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1 if suffix else 0)
