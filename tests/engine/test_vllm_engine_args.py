"""vLLM's engine argument names and spellings: dtype aliases, swap_space,
num_gpu_blocks_override and max_logprobs, from Python and from generated flags.

Oracles: the loaded weights' dtype, the pool's block counts (swap GiB / bytes per block),
and vLLM's documented defaults (max_logprobs 20).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from pagedkv.engine import EngineArgs, RequestRejected, SamplingParams
from pagedkv.worker.kv_cache import bytes_per_block
from tests.engine.conftest import make_engine, run_to_completion

GIB = 1024**3


@pytest.mark.parametrize(
    ("spelling", "dtype"),
    [
        ("auto", torch.float32),  # on CPU, as vLLM
        ("float", torch.float32),
        ("float32", torch.float32),
        ("half", torch.float16),
        ("float16", torch.float16),
        ("bfloat16", torch.bfloat16),
    ],
)
def test_vllm_dtype_spellings_load_that_dtype(engine_zoo, spelling, dtype):
    engine = make_engine(engine_zoo, "llama", dtype=spelling)
    assert next(engine.runner.model.parameters()).dtype == dtype


def test_an_unknown_dtype_names_the_spellings():
    with pytest.raises(ValueError, match="dtype must be one of .*'half'.* got 'fp64'"):
        EngineArgs(dtype="fp64")


def test_swap_space_is_gib_of_cpu_blocks_and_swap_space_gb_still_works(engine_zoo):
    # make_engine also passes swap_space_gb=0.01: vLLM's name, when given, wins.
    by_vllm_name = make_engine(engine_zoo, "llama", swap_space=0.02)
    by_old_name = make_engine(engine_zoo, "llama", swap_space_gb=0.02)
    per_block = bytes_per_block(by_vllm_name.config, 16, torch.float32)
    assert by_vllm_name.manager.num_cpu_blocks == int(0.02 * GIB) // per_block
    assert by_old_name.manager.num_cpu_blocks == by_vllm_name.manager.num_cpu_blocks


def test_num_gpu_blocks_override_sizes_the_pool(engine_zoo):
    # make_engine also passes num_gpu_blocks=128: vLLM's name, when given, wins.
    engine = make_engine(engine_zoo, "llama", num_gpu_blocks_override=77)
    assert engine.manager.num_gpu_blocks == 77


def test_vllms_defaults_and_names_are_taken_as_ours(engine_zoo):
    """vLLM's None for quantization and enable_prefix_caching (its defaults), a torch.dtype,
    and kv_cache_memory_bytes (vLLM's name for kv_cache_memory) mean what they mean there."""
    args = EngineArgs(
        model="unused", quantization=None, enable_prefix_caching=None, enable_chunked_prefill=None
    )
    assert (args.quantization, args.enable_prefix_caching) == ("auto", True)
    assert args.enable_chunked_prefill is True
    # vLLM's EngineArgs leaves these None to pick them at start (its spec_decode example
    # passes max_num_seqs=None): the engine's own defaults, as if not given.
    picked = EngineArgs(
        model="unused", block_size=None, max_num_seqs=None, max_num_batched_tokens=None
    )
    default = EngineArgs(model="unused")
    assert (picked.block_size, picked.max_num_seqs, picked.max_num_batched_tokens) == (
        default.block_size,
        default.max_num_seqs,
        default.max_num_batched_tokens,
    )
    assert EngineArgs(model="unused", dtype=torch.float16).resolved_dtype == "float16"
    assert EngineArgs(model="unused", dtype=torch.bfloat16).resolved_dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineArgs(model="unused", dtype=torch.int8)
    by_bytes = make_engine(engine_zoo, "llama", num_gpu_blocks=None, kv_cache_memory_bytes=2**20)
    per_block = bytes_per_block(by_bytes.config, 16, torch.float32)
    assert by_bytes.manager.num_gpu_blocks == 2**20 // per_block


def test_the_vllm_flags_are_generated():
    parser = argparse.ArgumentParser()
    assert EngineArgs.add_cli_args(parser) is parser  # vLLM's examples chain it
    args = EngineArgs.from_cli_args(
        parser.parse_args(
            [
                "--swap-space",
                "2",
                "--num-gpu-blocks-override",
                "64",
                "--max-logprobs",
                "5",
                "--dtype",
                "half",
                "--trust-remote-code",
                "--enforce-eager",
                "--no-enable-chunked-prefill",
                "--disable-log-stats",
            ]
        )
    )
    assert args.trust_remote_code is True and args.enforce_eager is True
    assert args.enable_chunked_prefill is False and args.disable_log_stats is True
    assert args.swap_space_gb == 2.0
    assert args.num_gpu_blocks == 64
    assert args.max_logprobs == 5
    assert args.resolved_dtype == "float16"


def test_more_logprobs_than_max_logprobs_are_refused_naming_both(engine_zoo):
    engine = make_engine(engine_zoo, "llama", max_logprobs=5)
    with pytest.raises(RequestRejected, match="logprobs is 6, .*at most 5 \\(max_logprobs"):
        engine.add_request("r", [5, 6, 7], SamplingParams(logprobs=6))
    engine.add_request("ok", [5, 6, 7], SamplingParams(logprobs=5, max_tokens=1))


def test_max_logprobs_defaults_to_vllm_20_and_may_be_raised(engine_zoo):
    assert EngineArgs().max_logprobs == 20
    with pytest.raises(RequestRejected, match="logprobs is 21"):
        make_engine(engine_zoo, "llama").add_request("r", [5, 6], SamplingParams(logprobs=21))
    engine = make_engine(engine_zoo, "llama", max_logprobs=30)
    engine.add_request("r", [5, 6], SamplingParams(logprobs=30, max_tokens=1))
    [delta] = [d for ds in run_to_completion(engine) for d in ds]
    assert len(delta.outputs[0].logprobs[0]) >= 30  # the chosen token and the top 30


def test_max_logprobs_minus_one_lifts_the_cap_as_vllms(engine_zoo):
    engine = make_engine(engine_zoo, "llama", max_logprobs=-1)
    vocab_size = engine.config.vocab_size
    engine.add_request("r", [5, 6], SamplingParams(logprobs=vocab_size, max_tokens=1))
    [delta] = [d for ds in run_to_completion(engine) for d in ds]
    assert len(delta.outputs[0].logprobs[0]) == vocab_size  # every token, the chosen among them
    for bad in (-2, 0, 1.5, True):
        with pytest.raises(ValueError, match=r"max_logprobs must be a positive integer or -1 \("):
            EngineArgs(model="unused", max_logprobs=bad)


def test_logprobs_minus_one_is_every_token_as_vllms(engine_zoo):
    """vLLM's -1: the whole vocabulary's logprobs, which max_logprobs caps as any count."""
    engine = make_engine(engine_zoo, "llama", max_logprobs=-1)
    vocab_size = engine.config.vocab_size
    params = SamplingParams(logprobs=-1, prompt_logprobs=-1, max_tokens=1)
    engine.add_request("r", [5, 6, 7], params)
    assert params.logprobs == -1  # the caller's object is left as it was
    deltas = [d for ds in run_to_completion(engine) for d in ds]
    assert [len(p) for p in deltas[-1].outputs[0].logprobs] == [vocab_size]
    prompt = next(d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None)
    assert [len(p) for p in prompt[1:]] == [vocab_size, vocab_size]
    with pytest.raises(
        RequestRejected, match=rf"logprobs=-1 \(every token: {vocab_size}\), .*at most 20"
    ):
        make_engine(engine_zoo, "llama").add_request("r", [5, 6], SamplingParams(logprobs=-1))
    with pytest.raises(ValueError, match="logprobs must be >= 0, got -2"):
        SamplingParams(logprobs=-2)


def test_default_dtype_is_auto_as_vllms():
    assert EngineArgs().dtype == "auto"
    assert EngineArgs(device="cpu").resolved_dtype == "float32"


@pytest.mark.parametrize("size", [float("inf"), float("nan"), -1.0])
def test_swap_sizes_must_be_finite_gib(size):
    for name in ("swap_space", "swap_space_gb", "kv_offloading_size"):
        with pytest.raises(ValueError, match=f"{name} must be a finite number >= 0"):
            EngineArgs(model="unused", **{name: size})


def test_swap_space_beyond_the_hosts_memory_is_refused_before_allocating(engine_zoo):
    """vLLM's rule: CPU pools above 70% of the host's physical memory are an error."""
    import os

    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    with pytest.raises(ValueError, match="more than 70% of this host's"):
        make_engine(
            engine_zoo, "llama", swap_space=host_gib * 0.5, kv_offloading_size=host_gib * 0.25
        )


def test_seed_and_device_are_checked_when_the_args_are_made():
    """vLLM's V1 engine takes seed None as 0; a seed that is not an integer, or a device that
    is not cpu, cuda or cuda:N (or a CUDA device this torch does not see), is a ValueError."""
    assert EngineArgs(model="unused", seed=None).seed == 0
    for seed in ("abc", 1.5, True):
        with pytest.raises(ValueError, match="seed must be an integer"):
            EngineArgs(model="unused", seed=seed)
    for device in ("tpu", "meta", "cuda:x", 0):
        with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
            EngineArgs(model="unused", device=device)
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last, on any machine
    with pytest.raises(ValueError, match="sees no such CUDA device"):
        EngineArgs(model="unused", device=missing)


@pytest.mark.parametrize(
    ("flags", "note"),
    [
        (["--structured-outputs-config", '{"backend": "xgrammar"}'], "not 'xgrammar'"),
        (["--guided-decoding-backend", "outlines"], "not 'outlines'"),
        (["--structured-outputs-config", '{"backend": "guidance"}'], None),
        (["--structured-outputs-config", '{"disable_any_whitespace": true}'], None),
    ],
)
def test_vllms_structured_output_backends_are_taken_with_a_note(flags, note, capsys) -> None:
    """vLLM's backends ("auto", "guidance", "xgrammar", "outlines", "lm-format-enforcer", from
    its StructuredOutputsConfig) are taken; one other than llguidance's ("guidance") is noted,
    since outputs are held by llguidance whatever it names."""
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    EngineArgs.from_cli_args(parser.parse_args(flags))
    printed = capsys.readouterr().err
    assert (note in printed) if note else "structured outputs" not in printed


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(guided_decoding_backend="xgrammars"), "backend 'xgrammars' is not one of vLLM's"),
        (dict(structured_outputs_config={"reasoning": 1}), "'reasoning' not taken"),
        (dict(structured_outputs_config={"disable_fallback": 1}), "must be true or false"),
        (dict(structured_outputs_config="backend=xgrammar"), "is not valid JSON"),
        (dict(logprobs_mode="processed_logprobs"), "logprobs_mode 'processed_logprobs' is not"),
    ],
)
def test_bad_vllm_output_settings_are_refused_by_name(settings, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="unused", **settings)
