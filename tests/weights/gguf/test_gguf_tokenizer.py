"""Tokenizers rebuilt from GGUF metadata: SentencePiece-style scores, pre-tokenisers, specials."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.model.errors import MalformedModelFile
from pagedkv.weights.gguf.file import GGUFFile
from pagedkv.weights.gguf.model import GGUFModel
from pagedkv.weights.gguf.tokenizer import tokenizer_files
from tests.weights.gguf.writer import tokenizer_metadata, write_gguf

UNKNOWN, CONTROL, USER_DEFINED, BYTE, NORMAL = 2, 3, 4, 6, 1
# A hand-made SentencePiece vocabulary: pieces and scores (higher merges first).
PIECES = {
    "\u2581": -10.0,
    "h": -11.0,
    "e": -12.0,
    "l": -13.0,
    "o": -14.0,
    "w": -15.0,
    "r": -16.0,
    "d": -17.0,
    "he": -3.0,
    "el": -1.0,
    "\u2581h": -2.0,
    "ll": -4.0,
    "\u2581he": -5.0,
    "\u2581hell": -6.0,
    "\u2581hello": -7.0,
    "or": -8.0,
    "\u2581w": -8.5,
    "\u2581wor": -9.0,
    "ld": -9.5,
    "\u2581world": -9.7,
}


def _spm_file(tmp_path, **extra):
    tokens = ["<unk>", "<s>", "</s>", "<|user|>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL, USER_DEFINED] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    for piece, score in PIECES.items():
        tokens.append(piece)
        types.append(NORMAL)
        scores.append(score)
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    } | extra
    path = write_gguf(tmp_path / "spm.gguf", "llama", metadata, {"x": np.zeros(1, np.float32)})
    return tokenizer_files(GGUFFile(path)).tokenizer, tokens.index


def test_sentencepiece_merges_the_highest_scoring_pair_first(tmp_path):
    tokenizer, piece_id = _spm_file(tmp_path)
    # "▁hel": pairs ▁h (-2), he (-3), el (-1): "el" first, then "▁h"; "▁he" never forms.
    assert tokenizer.encode("hel").ids == [1, piece_id("\u2581h"), piece_id("el")]
    # "▁hello": "el" wins again, so "▁he", "ll" and "▁hello" are out of reach; "▁world" forms
    # through or -> ▁w -> ▁wor -> ▁wor+ld.
    expected = ["\u2581h", "el", "l", "o", "\u2581world"]
    assert tokenizer.encode("hello world").ids == [1, *map(piece_id, expected)]


def test_sentencepiece_falls_back_to_bytes_and_decodes_back(tmp_path):
    tokenizer, piece_id = _spm_file(tmp_path)
    ids = tokenizer.encode("he\u00e9").ids
    assert ids == [1, piece_id("\u2581he"), piece_id("<0xC3>"), piece_id("<0xA9>")]
    assert tokenizer.decode(ids) == "he\u00e9"
    assert tokenizer.decode(tokenizer.encode("hello  world").ids) == "hello  world"


def test_sentencepiece_without_space_prefix(tmp_path):
    tokenizer, piece_id = _spm_file(
        tmp_path,
        **{"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False},
    )
    assert tokenizer.encode("hel").ids == [piece_id("h"), piece_id("el")]


def test_control_tokens_are_special_and_user_defined_tokens_are_text(tmp_path):
    tokenizer, _ = _spm_file(tmp_path)
    ids = tokenizer.encode("<|user|>hello</s>", add_special_tokens=False).ids
    assert ids[0] == 3 and ids[-1] == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<|user|> hello"


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt-2", ["Ġ12345", "Ġok"]),
        ("smollm", ["Ġ", "1", "2", "3", "4", "5", "Ġok"]),
        ("llama-bpe", ["Ġ", "123", "45", "Ġok"]),
        ("llama-v3", ["Ġ", "123", "45", "Ġok"]),  # llama.cpp's other names of Llama 3's rules
        ("falcon3", ["Ġ", "123", "45", "Ġok"]),
        ("qwen2", ["Ġ", "1", "2", "3", "4", "5", "Ġok"]),
        ("deepseek-r1-qwen", ["Ġ", "1", "2", "3", "4", "5", "Ġok"]),
    ],
)
def test_pre_tokenisers_split_digits_like_llama_cpp(tiny_gguf, pre, pieces):
    path = tiny_gguf("llama", metadata={"tokenizer.ggml.pre": pre})
    tokenizer = GGUFModel.open(path).tokenizer().tokenizer
    assert [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(" 12345 ok")] == pieces
    # Qwen2's rules normalise to NFC (a decomposed é becomes one character), the others not.
    composed = tokenizer.normalizer is not None and tokenizer.normalizer.normalize_str("e\u0301")
    assert (composed == "\u00e9") == (pre in ("qwen2", "deepseek-r1-qwen"))


def test_eos_ids_gather_eos_eot_and_eom(tiny_gguf):
    path = tiny_gguf("llama", metadata={"tokenizer.ggml.eot_token_id": 0})
    assert GGUFModel.open(path).tokenizer().eos_token_ids == (2, 0)


def _with_tokens(zoo, pre: str, extra: dict[str, int], **keys) -> dict:
    """The tiny llama's vocabulary as GGUF metadata under pre-tokeniser `pre`, with `extra`
    tokens (text -> token type) appended and `keys` set."""
    metadata = tokenizer_metadata(zoo.folder("llama") / "tokenizer.json", pre=pre)
    metadata["tokenizer.ggml.tokens"] = [*metadata["tokenizer.ggml.tokens"], *extra]
    metadata["tokenizer.ggml.token_type"] = [
        *metadata["tokenizer.ggml.token_type"],
        *extra.values(),
    ]
    return metadata | keys


def test_generation_ends_on_the_tokens_llama_cpp_finds_by_their_text(zoo, tiny_gguf):
    """A Llama 3.1 Instruct file names only <|eot_id|> as eos; llama.cpp also ends on
    <|eom_id|> and <|end_of_text|> (as the model's generation_config lists), found by their
    text, and not on other control tokens. The file's own ids come first."""
    extra = {"<|end_of_text|>": CONTROL, "<|eom_id|>": CONTROL, "<|eot_id|>": CONTROL}
    extra |= {"<|start_header_id|>": CONTROL, "<|endoftext|>": NORMAL}
    metadata = _with_tokens(zoo, "llama-bpe", extra)
    tokens = metadata["tokenizer.ggml.tokens"]
    metadata["tokenizer.ggml.eos_token_id"] = tokens.index("<|eot_id|>")
    tokenizer = GGUFModel.open(tiny_gguf("llama", metadata=metadata)).tokenizer()
    ends = ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "<|endoftext|>")
    assert tokenizer.eos_token_ids == tuple(tokens.index(text) for text in ends)
    assert tokenizer.eos_token_id == tokens.index("<|eot_id|>")


def test_llama3_vocabularies_take_a_word_they_hold_whole_before_any_merge(zoo, tiny_gguf):
    """llama.cpp's ignore_merges for Llama 3's pre-tokeniser names (Llama 3's tokenizer.json
    sets it too): a word the vocabulary holds is one token even where no merge chain builds
    it; other pre-tokenisers merge as BPE does. Llama 3's names also add BOS when the file
    does not say (llama.cpp's default), other byte-level ones do not."""
    for pre in ("llama-bpe", "gpt-2"):
        metadata = _with_tokens(
            zoo, pre, {"Ġzebra": NORMAL}, **{"tokenizer.ggml.add_bos_token": None}
        )
        tokens = metadata["tokenizer.ggml.tokens"]
        tokenizer = GGUFModel.open(tiny_gguf("llama", metadata=metadata)).tokenizer()
        ids = tokenizer.encode("a zebra")
        whole = tokens.index("Ġzebra") in ids
        assert whole == (pre == "llama-bpe"), (pre, [tokens[i] for i in ids])
        assert (ids[0] == tokenizer.bos_token_id) == (pre == "llama-bpe")
        assert tokenizer.decode(ids, skip_special_tokens=True) == "a zebra"
    said = _with_tokens(zoo, "llama-bpe", {}, **{"tokenizer.ggml.add_bos_token": False})
    unsaid = GGUFModel.open(tiny_gguf("llama", metadata=said)).tokenizer()
    assert unsaid.encode("a") == unsaid.encode("a", add_special_tokens=False)


def test_a_merge_of_no_token_and_more_tokens_than_ids_are_malformed_files(zoo, tiny_gguf):
    """A merge naming a token the vocabulary lacks, and a vocabulary of more tokens than the
    model's embedding rows (as llama.cpp refuses it; the extra ids would fail only once
    reached), are errors naming the file and the key."""
    bad_merge = _with_tokens(zoo, "gpt-2", {})
    bad_merge["tokenizer.ggml.merges"] = [*bad_merge["tokenizer.ggml.merges"], "Ġqqq zz"]
    with pytest.raises(MalformedModelFile, match=r"\.gguf: tokenizer\.ggml\.merges: .*qqq"):
        GGUFModel.open(tiny_gguf("llama", metadata=bad_merge)).tokenizer()
    rows = GGUFModel.open(tiny_gguf("llama")).config.vocab_size
    extra = {f"<extra_{i}>": NORMAL for i in range(rows + 1 - 300)}
    too_many = _with_tokens(zoo, "gpt-2", extra)
    count = len(too_many["tokenizer.ggml.tokens"])
    assert count == rows + 1
    with pytest.raises(
        MalformedModelFile,
        match=f"tokenizer.ggml.tokens has {count} tokens, more than the model's {rows} ids",
    ):
        GGUFModel.open(tiny_gguf("llama", metadata=too_many))
