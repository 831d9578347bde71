"""The two baselines, both transformers on the same weights: static `generate` batches and its
continuous batching (paged cache and scheduler).

transformers is needed only here and by the random model (it is the baseline), never by the
engine. Each run counts useful tokens (each request's requested output) apart from generated
ones, since a static batch keeps generating for a request until its longest request ends.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pagedkv.bench.results import RunResult
from pagedkv.bench.workloads import Workload


def load_hf_model(folder: str) -> Any:
    """The folder's causal LM in float32, in eval mode, with transformers' warnings silenced."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def run_hf_generate(model: Any, workload: Workload, round_index: int, batch_size: int) -> RunResult:
    """Left-padded static batches in arrival order; each runs until its longest request ends."""
    pad_id = _pad_token_id(model)
    useful = generated = 0
    started = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        output_lens = workload.output_lens[first : first + batch_size]
        width = max(map(len, prompts))
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        num_new = max(output_lens)
        with torch.inference_mode():
            output = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=num_new,
                min_new_tokens=num_new,  # ignore_eos: every row runs to the batch's end
                do_sample=False,
                pad_token_id=pad_id,
            )
        new_tokens = output.shape[1] - width
        generated += new_tokens * len(prompts)
        useful += sum(min(n, new_tokens) for n in output_lens)
    seconds = time.perf_counter() - started
    return RunResult(
        "hf-generate",
        round_index,
        seconds,
        useful,
        generated,
        {"batch_size": batch_size},
    )


def run_hf_continuous_batching(
    model: Any,
    workload: Workload,
    round_index: int,
    *,
    kv_tokens: int,
    page_size: int,
    max_batch_tokens: int,
    max_requests: int,
) -> RunResult:
    """transformers' paged cache and scheduler with the same KV tokens and token budget.

    `generate_batch` takes one max_new_tokens for all prompts, so this drives its manager the
    way `generate_batch` does, giving each request its own length and no EOS (-1).
    """
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(workload.output_lens),
        eos_token_id=-1,
        pad_token_id=_pad_token_id(model),
    )
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=max(1, kv_tokens // page_size),
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests,
    )
    request_ids = [f"round-{round_index}-{i}" for i in range(len(workload.prompts))]
    produced: dict[str, int] = {}
    with model.continuous_batching_context_manager(
        generation_config=generation_config,
        continuous_batching_config=cb_config,
        block=True,
        timeout=30,
    ) as manager:
        started = time.perf_counter()
        for request_id, prompt, output_len in zip(
            request_ids, workload.prompts, workload.output_lens, strict=True
        ):
            manager.add_request(
                prompt, request_id=request_id, max_new_tokens=output_len, eos_token_id=-1
            )
        while len(produced) < len(request_ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching stopped unexpectedly")
                continue
            if result.is_finished():
                produced[result.request_id] = len(result.generated_tokens)
        seconds = time.perf_counter() - started
        cache_tokens = manager.cache.num_blocks * page_size if hasattr(manager, "cache") else None
    useful = sum(
        min(produced.get(request_id, 0), output_len)
        for request_id, output_len in zip(request_ids, workload.output_lens, strict=True)
    )
    return RunResult(
        "hf-cb",
        round_index,
        seconds,
        useful,
        sum(produced.values()),
        {"cache_tokens": cache_tokens},
    )


def _pad_token_id(model: Any) -> int:
    config = model.generation_config
    for candidate in (config.pad_token_id, config.eos_token_id, model.config.eos_token_id, 0):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0
