"""Quantised weights are not sharded: a GGUF file's quantised blocks load as float shards
under tensor parallelism (quantization "auto"), giving the output of one process that
dequantises them too ("none"); int8/int4 are refused (see test_tp_failures.py)."""

from __future__ import annotations

from gguf import GGMLQuantizationType as QType

from pagedkv.engine import LLM, SamplingParams
from tests.model.tiny_models import random_prompt

SETTINGS = dict(num_gpu_blocks=32, swap_space_gb=0.01, max_model_len=256, threads=1)
PROMPTS = [random_prompt(length, seed=length) for length in (4, 19, 40)]


def test_a_gguf_file_of_q8_0_blocks_runs_dequantised_on_two_ranks(tiny_gguf):
    path = str(tiny_gguf("qwen2", qtype=QType.Q8_0))  # tied head, q/k/v biases
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    single = LLM(path, quantization="none", **SETTINGS)
    parallel = LLM(path, tensor_parallel_size=2, **SETTINGS)
    try:
        want = [
            out.outputs[0].token_ids for out in single.generate(PROMPTS, greedy, use_tqdm=False)
        ]
        got = [
            out.outputs[0].token_ids for out in parallel.generate(PROMPTS, greedy, use_tqdm=False)
        ]
    finally:
        parallel.engine.shutdown()
    assert got == want
