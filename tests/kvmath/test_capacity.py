"""Capacity planning: the issue's figures, the GPU pool terms, presets, and the command."""

import contextlib
import io
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.cli import main
from pagedkv.kvmath.capacity import PlanError, PoolBudget, plan_capacity
from pagedkv.kvmath.presets import (
    GPU_PRESETS,
    MODEL_PRESETS,
    UnknownPreset,
    dense_param_count,
    gpu_preset,
    resolve_model,
)
from pagedkv.kvmath.spec import GB, ConfigError, KVSpec, MiB
from pagedkv.memory import KVCacheManager, NoContiguousSpace, NoFreeBlocks, SlabAllocator
from tests.model.tiny_models import TINY_MODELS

LLAMA_3_8B = KVSpec.from_hf_config(MODEL_PRESETS["llama-3-8b"].config, kv_dtype="fp16")
LENGTHS = [2048, 8192, 32_768, 131_072]


def test_pool_of_53_gb_holds_about_404k_tokens_of_llama_3_8b():
    plan = plan_capacity(LLAMA_3_8B, PoolBudget.given(53 * GB), LENGTHS)
    assert plan.pool_tokens == 53 * GB // 131_072 == 404_357
    assert plan.pool_blocks == 53 * GB // (16 * 131_072) == 25_272


def test_a_request_holds_whole_blocks_of_its_tokens():
    """100 tokens in blocks of 7: 15 blocks, 105 slots of 131,072 B, what the pool gives it."""
    plan = plan_capacity(LLAMA_3_8B, PoolBudget.given(10 * GB), [100], block_size=7)
    [row] = plan.rows
    assert (row.blocks_per_request, row.bytes_per_request) == (15, 105 * 131_072)
    assert row.max_concurrency == 10 * GB // (7 * 131_072) // 15 == 726


def test_pool_of_53_gb_concurrency_per_length():
    plan = plan_capacity(LLAMA_3_8B, PoolBudget.given(53 * GB), LENGTHS)
    # 25,272 blocks over 128, 512, 2,048 and 8,192 blocks per request.
    assert [row.max_concurrency for row in plan.rows] == [197, 49, 12, 3]
    assert [row.blocks_per_request for row in plan.rows] == [128, 512, 2048, 8192]
    assert [row.beyond_context for row in plan.rows] == [False, False, True, True]
    served = plan_capacity(LLAMA_3_8B, PoolBudget.given(53 * GB), LENGTHS, max_model_len=2048)
    assert [row.beyond_context for row in served.rows] == [False, True, True, True]
    assert served.context == 2048


def test_slab_at_8192_against_paged_at_1000_tokens_in_50_gb():
    plan = plan_capacity(
        LLAMA_3_8B, PoolBudget.given(50 * GB), LENGTHS, avg_tokens=1000, max_model_len=8192
    )
    comparison = plan.comparison
    # Slab: 50e9 / (8,192 x 131,072 B) = 46.6 reservations.
    assert comparison.slab_concurrency == 46
    # Paged: 1,000 tokens fill 63 blocks; 23,841 blocks / 63 = 378.4 ("about 380").
    assert comparison.paged_blocks_per_request == 63
    assert comparison.paged_concurrency == 378
    assert comparison.gain == pytest.approx(378 / 46)


def test_plan_concurrency_is_what_the_memory_allocators_actually_admit():
    pool = PoolBudget.given(50 * GB)
    plan = plan_capacity(LLAMA_3_8B, pool, [2048], avg_tokens=1000, max_model_len=8192)
    manager = KVCacheManager(plan.pool_blocks, 16, enable_prefix_caching=False)
    for seq in range(plan.rows[0].max_concurrency):
        manager.allocate(seq, [0] * 2048)
    with pytest.raises(NoFreeBlocks):
        manager.allocate("one more", [0] * 2048)
    slab = SlabAllocator(pool.pool_bytes // LLAMA_3_8B.bytes_per_token)
    for req in range(plan.comparison.slab_concurrency):
        slab.reserve(req, 8192)
    with pytest.raises(NoContiguousSpace):
        slab.reserve("one more", 8192)


def test_a_sliding_window_model_holds_every_token_as_the_engine_keeps_them():
    """pagedkv's block table keeps the blocks behind a window: the plan counts them (and
    agrees with the engine's start-up figure, `test_the_plan_states_what_the_engine_holds`)."""
    spec = KVSpec.from_hf_config(MODEL_PRESETS["mistral-7b"].config)
    assert spec.sliding_window == 4096
    plan = plan_capacity(spec, PoolBudget.given(10 * GB), [2048, 32_768])
    assert [row.tokens_held for row in plan.rows] == [2048, 32_768]
    per_request = -(-32_768 // 16)
    assert plan.rows[1].max_concurrency == plan.pool_blocks // per_request
    assert plan.longest_request == min(plan.pool_blocks * 16, 32_768)


def test_longest_request_is_capped_by_pool_and_context():
    small = plan_capacity(LLAMA_3_8B, PoolBudget.given(GB // 2), [1024])
    assert small.longest_request == small.pool_blocks * 16 == 3808
    large = plan_capacity(LLAMA_3_8B, PoolBudget.given(53 * GB), [1024])
    assert large.longest_request == 8192


def test_gpu_pool_is_memory_times_utilization_minus_weights_and_activations():
    gpu = gpu_preset("h100-80gb")
    assert gpu.memory_bytes == 81_559 * MiB
    weights = resolve_model("llama-3-8b").weight_bytes
    assert weights == 8_030_261_248 * 2
    pool = PoolBudget.from_gpu(gpu.name, gpu.memory_bytes, 0.9, weights, 2 * GB)
    assert pool.pool_bytes == int(81_559 * MiB * 0.9) - 16_060_522_496 - 2 * GB


def test_gpu_pool_with_no_room_left_is_an_error():
    gpu = gpu_preset("l4")
    weights = resolve_model("llama-3-70b").weight_bytes
    with pytest.raises(PlanError, match="no room for KV cache on l4.*--tensor-parallel-size"):
        PoolBudget.from_gpu(gpu.name, gpu.memory_bytes, 0.9, weights, 2 * GB)
    with pytest.raises(PlanError, match="a smaller --activation-gb"):  # the weights would fit
        PoolBudget.from_gpu(gpu.name, gpu.memory_bytes, 0.9, 10 * GB, 20 * GB)
    with pytest.raises(PlanError, match="utilization"):
        PoolBudget.from_gpu(gpu.name, gpu.memory_bytes, 1.5, 0, 0)


def test_a_pool_smaller_than_one_block_is_an_error_naming_both():
    # One block of llama-3-8b at 16 tokens is 16 x 131,072 B = 2 MiB.
    with pytest.raises(
        PlanError,
        match=r"KV pool of 1.00 MB / 0.95 MiB holds no block: "
        r"one block of 16 tokens is 2.10 MB / 2.00 MiB",
    ):
        plan_capacity(LLAMA_3_8B, PoolBudget.given(10**6), [1024])


def test_bad_pool_and_lengths_are_errors():
    with pytest.raises(PlanError, match="positive"):
        PoolBudget.given(-1)
    with pytest.raises(PlanError, match="request length"):
        plan_capacity(LLAMA_3_8B, PoolBudget.given(GB), [0])
    with pytest.raises(PlanError, match="--avg-tokens"):
        plan_capacity(LLAMA_3_8B, PoolBudget.given(GB), [1], avg_tokens=9000, max_model_len=8192)


@pytest.mark.parametrize(
    "name", [name for name, preset in MODEL_PRESETS.items() if name != "deepseek-v3"]
)
def test_dense_presets_parameter_count_matches_their_config(name):
    # The published count and the config's shapes agree exactly: the preset values are
    # consistent with each other.
    preset = MODEL_PRESETS[name]
    assert dense_param_count(preset.config) == preset.num_params


def test_every_preset_loads_with_its_published_shape():
    for name in MODEL_PRESETS:
        model = resolve_model(name)
        assert model.spec.bytes_per_token > 0
        assert model.weight_bytes > 0
    assert resolve_model("llama-2-70b").spec.num_kv_heads == 8
    assert resolve_model("qwen2.5-0.5b").spec.bytes_per_token == 2 * 24 * 2 * 64 * 2
    assert resolve_model("deepseek-v3").weight_bytes == 671 * GB  # FP8 checkpoint


def test_gpu_presets_are_driver_reported_mib():
    assert set(GPU_PRESETS) == {
        "h100-80gb",
        "h200",
        "a100-80gb",
        "a100-40gb",
        "l40s",
        "l4",
        "rtx-4090",
    }
    assert GPU_PRESETS["a100-80gb"].memory_bytes == 80 * 2**30
    with pytest.raises(UnknownPreset, match="unknown GPU 'v100'"):
        gpu_preset("v100")


def test_model_folder_weights_come_from_its_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MODEL_PRESETS["llama-3-8b"].config))
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1024)
    model = resolve_model(str(tmp_path))
    assert model.weight_bytes == 1024
    assert model.spec.bytes_per_token == 131_072


def test_the_weights_counted_are_the_files_the_engine_reads(tmp_path):
    """The loader reads the shards the index names, else model.safetensors (hf_folder.py):
    Mistral's `consolidated.safetensors`, a second copy of the weights, is never counted."""
    (tmp_path / "config.json").write_text(json.dumps(MODEL_PRESETS["mistral-7b"].config))
    (tmp_path / "consolidated.safetensors").write_bytes(b"x" * 1024)
    assert "counted from config" in resolve_model(str(tmp_path)).weight_source
    (tmp_path / "model.safetensors").write_bytes(b"x" * 24)
    assert resolve_model(str(tmp_path)).weight_bytes == 24
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (tmp_path / shard).write_bytes(b"x" * 500)
    shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    assert resolve_model(str(tmp_path)).weight_bytes == 1000
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match="names shards that are not there: model-00002"):
        resolve_model(str(tmp_path))


def test_a_pool_given_directly_needs_no_weight_count(tmp_path, capsys):
    """A multimodal config nests the language model under text_config: its KV is read from
    there, and a pool given with --pool-gb needs no parameter count."""
    config = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3"}
    config["text_config"] = dict(MODEL_PRESETS["mistral-7b"].config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = resolve_model(str(tmp_path))
    assert model.spec.bytes_per_token == 131_072 and model.weight_bytes is None
    assert main(["plan", "--model", str(tmp_path), "--pool-gb", "10"]) == 0
    assert main(["plan", "--model", str(tmp_path), "--gpu", "l4"]) == 2
    assert "give --weights-gb" in capsys.readouterr().err


def test_config_file_weights_are_counted_from_the_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MODEL_PRESETS["mistral-7b"].config))
    assert resolve_model(str(path)).weight_bytes == 7_241_732_096 * 2


def test_unknown_model_is_an_error_listing_presets():
    with pytest.raises(UnknownPreset, match="neither a preset nor an existing path.*llama-3-8b"):
        resolve_model("llama-9b")


def test_mixture_of_experts_config_without_checkpoint_has_unknown_weights(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MODEL_PRESETS["deepseek-v3"].config))
    assert resolve_model(str(path)).weight_bytes is None
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        dense_param_count(MODEL_PRESETS["deepseek-v3"].config)


def test_plan_command_json_has_the_issue_figures(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--pool-gb", "53", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec"]["bytes_per_token"] == 131_072
    assert out["pool_tokens"] == 404_357
    assert [row["max_concurrency"] for row in out["rows"]] == [197, 49, 12, 3]


def test_plan_command_tables_show_pool_terms_and_comparison(capsys):
    argv = ["plan", "--model", "llama-3-8b", "--gpu", "h100-80gb", "--avg-tokens", "1000"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "81,559 MiB" in out
    assert "16.06" in out  # weights, GB
    assert "= KV pool" in out
    assert "paging fits" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-9b", "--pool-gb", "1"], "neither a preset"),
        (["--model", "llama-3-70b", "--gpu", "l4"], "no room for KV cache"),
        (["--model", "llama-3-8b", "--gpu", "v100"], "unknown GPU"),
        (["--model", "llama-3-8b", "--pool-gb", "20", "--max-loras", "3"], "needs --lora-rank"),
    ],
)
def test_plan_command_bad_input_is_a_one_line_error(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv plan: error:")
    assert message in err


def test_plan_command_refuses_gpu_terms_beside_a_given_pool(capsys):
    argv = ["plan", "--model", "llama-3-8b", "--pool-gb", "50"]
    assert main([*argv, "--gpu-memory-utilization", "0.5"]) == 2
    assert capsys.readouterr().err == (
        "pagedkv plan: error: --gpu-memory-utilization applies only with --gpu, to size the "
        "pool from a GPU; --pool-gb 50 gives the pool directly\n"
    )
    assert main([*argv, "--weights-gb", "16", "--activation-gb", "1"]) == 2
    assert "--weights-gb and --activation-gb apply only with --gpu" in capsys.readouterr().err


def test_plan_command_pool_smaller_than_a_block_is_a_one_line_error(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--pool-gb", "0.001"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv plan: error: a KV pool of 1.00 MB")
    assert "one block of 16 tokens is 2.10 MB / 2.00 MiB" in err


def test_plan_command_says_when_one_slab_does_not_fit(capsys):
    argv = ["plan", "--model", "llama-3.1-8b", "--pool-gb", "1", "--avg-tokens", "1000"]
    assert main([*argv, "--max-model-len", "100000"]) == 0
    assert "a slab of 100,000 tokens does not fit the pool" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("option", "value"),
    [
        (option, value)
        for option in ("--pool-gb", "--weights-gb", "--gpu-memory-utilization")
        for value in ("inf", "-inf", "nan", "-1", "0")
    ]
    + [("--activation-gb", value) for value in ("inf", "nan", "-1")]
    + [
        (option, value)
        for option in ("--block-size", "--avg-tokens", "--max-model-len", "--lengths")
        for value in ("inf", "nan", "-1", "0")
    ]
    + [("--gpu-memory-utilization", "1.5"), ("--pool-gb", "1e300"), ("--weights-gb", "1e300")],
)
def test_plan_command_refuses_numbers_out_of_range_when_parsed(capsys, option, value):
    pool = [] if option == "--pool-gb" else ["--gpu", "h100-80gb"]
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "llama-3-8b", *pool, f"{option}={value}"])
    assert exit_info.value.code == 2
    assert f"error: argument {option}: " in capsys.readouterr().err


def test_plan_command_rejects_negative_numbers(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "llama-3-8b", "--pool-gb", "-5"])
    assert exit_info.value.code == 2
    assert "must be a positive number, got -5" in capsys.readouterr().err


def test_plan_command_reads_a_bad_config_and_names_the_problem(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 0, "hidden_size": 64}))
    assert main(["plan", "--model", str(path), "--pool-gb", "1"]) == 2
    assert "num_hidden_layers must be a positive integer, got 0" in capsys.readouterr().err


def test_plan_imports_nothing_heavy():
    # `pagedkv plan` must answer instantly: no torch, numpy or matplotlib behind it.
    code = (
        "import sys, pagedkv.commands.plan; "
        "print(sorted(m for m in ('torch', 'numpy', 'matplotlib') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "[]", result.stderr


@pytest.mark.parametrize("preset", ["llama-3-8b", "qwen2.5-0.5b"])
def test_plan_command_refuses_a_max_model_len_beyond_the_models_context(capsys, preset):
    context = MODEL_PRESETS[preset].config["max_position_embeddings"]
    argv = ["plan", "--model", preset, "--pool-gb", "10", "--avg-tokens", "100"]
    assert main([*argv, "--max-model-len", str(context)]) == 0
    capsys.readouterr()
    assert main([*argv, "--max-model-len", str(context + 1)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"pagedkv plan: error: max_model_len {context + 1} is beyond the model's context "
        f"length {context} (max_position_embeddings)\n"
    )


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_plan_command_sizes_a_gguf_file_as_the_folder_it_was_written_from(
    zoo, tiny_gguf, capsys, name
):
    import gguf

    path = tiny_gguf(name)
    argv = ["plan", "--kv-dtype", "fp16", "--gpu", "l4", "--json", "--model"]
    assert main([*argv, str(zoo.folder(name))]) == 0
    from_folder = json.loads(capsys.readouterr().out)
    assert main([*argv, str(path)]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert from_file["model"] == path.stem
    assert from_file["spec"] == from_folder["spec"]
    assert from_file["rows"] == from_folder["rows"]
    # On a GPU pagedkv loads the weights in bfloat16: the file's values (gguf's own reader
    # counts them) at 2 bytes each, and the float32 folder's at half its files' size (their
    # headers aside).
    values = sum(int(tensor.n_elements) for tensor in gguf.GGUFReader(path).tensors)
    assert from_file["pool"]["weight_bytes"] == 2 * values
    assert 0 <= from_folder["pool"]["weight_bytes"] - 2 * values < 16_384
    # Without --kv-dtype, KV is stored as the model is loaded: bfloat16 on a GPU.
    assert main(["plan", "--gpu", "l4", "--json", "--model", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["kv_dtype"] == "bf16"
    assert main(["plan", "--pool-gb", "1", "--json", "--model", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["kv_dtype"] == "fp32"


def test_plan_command_names_a_malformed_gguf_file(tmp_path, capsys):
    path = tmp_path / "cut.gguf"
    path.write_bytes(b"GGUF" + bytes(8))
    assert main(["plan", "--model", str(path), "--pool-gb", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagedkv plan: error: {path}")
    assert len(err.splitlines()) == 1


def test_plan_marks_more_requests_than_a_step_runs(capsys):
    """The concurrency is the memory's; a step runs at most max_num_seqs (the engine's
    default, which the note quotes), so a row above it says the others wait."""
    from pagedkv.commands.plan import DEFAULT_MAX_NUM_SEQS
    from pagedkv.engine.args import EngineArgs

    assert EngineArgs.max_num_seqs == DEFAULT_MAX_NUM_SEQS
    assert main(["plan", "--model", "llama-3-8b", "--pool-gb", "53", "--lengths", "128,2k"]) == 0
    out = capsys.readouterr().out
    assert "3,159 s" in out and "197 s" not in out and "at most max_num_seqs" in out


def test_an_fp8_checkpoint_keeps_its_bytes_on_a_gpu(capsys):
    """Sizing on a GPU narrows wider floats to bfloat16's 2 bytes; an fp8 checkpoint stays
    1 byte a value (DeepSeek-V3's 671 B parameters: 671 GB, not twice that)."""
    argv = ["plan", "--model", "deepseek-v3", "--gpu", "h200", "--tensor-parallel-size", "8"]
    assert main([*argv, "--json"]) == 0
    pool = json.loads(capsys.readouterr().out)["pool"]
    assert pool["weight_bytes"] == MODEL_PRESETS["deepseek-v3"].num_params // 8


@settings(max_examples=60, deadline=None)
@given(blocks=st.integers(1, 10**6))
def test_plan_pool_gb_of_exactly_n_blocks_is_their_bytes(blocks):
    """--pool-gb is in 10^9 bytes: n Llama 3 8B blocks (2 MiB each) given in GB are n blocks'
    bytes, though the float times 10^9 may fall a hair short of that integer."""
    per_block = 131_072 * 16
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        argv = ["plan", "--model", "llama-3-8b", "--pool-gb", repr(blocks * per_block / 10**9)]
        assert main([*argv, "--json"]) == 0
    assert json.loads(out.getvalue())["pool"]["pool_bytes"] == blocks * per_block


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_every_tiny_models_parameters_are_counted_as_transformers_builds_them(zoo, name):
    """The count from the config's shapes against transformers' own model of it (shared
    embeddings once, Qwen2's q/k/v biases, Qwen3's per-head q/k norms)."""
    config = json.loads((zoo.folder(name) / "config.json").read_text())
    assert dense_param_count(config) == sum(p.numel() for p in zoo.hf(name).parameters())


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("attention_bias", [False, True])
@pytest.mark.parametrize("mlp_bias", [False, True])
def test_every_familys_bias_switches_are_counted_as_transformers_reads_them(
    family, attention_bias, mlp_bias
):
    """transformers builds the model of each config (on the meta device: shapes only); the
    count from the config alone, with or without model_type beside architectures, agrees."""
    import torch
    import transformers

    architecture = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    fields = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, head_dim=16, tie_word_embeddings=False,
        attention_bias=attention_bias, mlp_bias=mlp_bias,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(family, **fields)
        )
    expected = sum(p.numel() for p in model.parameters())
    config = {"architectures": [f"{architecture[family]}ForCausalLM"], **fields}
    assert dense_param_count({**config, "model_type": family}) == expected
    assert dense_param_count(config) == expected


def llama_3_8b_config(tmp_path, **changes) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**MODEL_PRESETS["llama-3-8b"].config, **changes}))
    return str(path)


def test_a_pre_quantised_config_is_not_sized_as_its_torch_dtype(tmp_path, capsys):
    """An fp8 checkpoint's config still says bfloat16: with no files to measure, its weights
    are unknown (a pool from a GPU needs --weights-gb, which the table then names)."""
    path = llama_3_8b_config(tmp_path, quantization_config={"quant_method": "fp8"})
    assert resolve_model(path).weight_bytes is None
    assert main(["plan", "--model", path, "--gpu", "h100-80gb"]) == 2
    error = capsys.readouterr().err
    assert "a pre-quantised config (fp8)" in error and "give --weights-gb" in error
    assert main(["plan", "--model", path, "--gpu", "h100-80gb", "--weights-gb", "8.5"]) == 0
    weights = next(line for line in capsys.readouterr().out.splitlines() if "- weights" in line)
    assert "8.50" in weights and "--weights-gb" in weights and "params" not in weights


@pytest.mark.parametrize("key", ["intermediate_size", "vocab_size", "hidden_size"])
def test_a_weight_shape_below_one_is_named(tmp_path, capsys, key):
    path = llama_3_8b_config(tmp_path, **{key: -14336})
    with pytest.raises(ConfigError, match=f"{key} must be a positive integer, got -14336"):
        dense_param_count(json.loads((tmp_path / "config.json").read_text()))
    assert main(["plan", "--model", path, "--gpu", "h100-80gb"]) == 2
    assert f"{key} must be a positive integer" in capsys.readouterr().err


def test_a_family_pagedkv_does_not_run_is_sized_with_a_note(tmp_path, capsys):
    gemma = llama_3_8b_config(tmp_path, architectures=["Gemma2ForCausalLM"], model_type="gemma2")
    assert main(["plan", "--model", gemma, "--pool-gb", "10", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("Gemma2ForCausalLM is not a family pagedkv runs" in note for note in notes)
    for model in ("llama-3-8b", "deepseek-v3", llama_3_8b_config(tmp_path)):
        assert (
            main(["plan", "--model", model, "--pool-gb", "10", "--json", "--device", "cuda"]) == 0
        )
        assert json.loads(capsys.readouterr().out)["notes"] == []


def test_a_config_dtype_the_planner_cannot_size_is_named_with_its_key(tmp_path, capsys):
    path = llama_3_8b_config(tmp_path, torch_dtype="float64")
    assert main(["plan", "--model", path, "--pool-gb", "10"]) == 2
    assert f"{path}: torch_dtype 'float64' is not a dtype" in capsys.readouterr().err
