"""A GGUF file's tokenizer metadata -> the tokenizer files of a Hugging Face folder.

GGUF stores the vocabulary as arrays (`tokenizer.ggml.tokens`, `.token_type`, and `.merges`
for byte-level BPE or `.scores` for SentencePiece-style vocabularies) plus the name of the
pre-tokeniser; the splitting rules themselves live in llama.cpp's code. This module rebuilds
them with the `tokenizers` library and returns the three files a folder would hold
(`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`), so a loaded and a
converted GGUF model tokenise identically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from pagedkv.model.errors import MalformedModelFile, UnsupportedModel
from pagedkv.weights.gguf.file import GGUFFile

# llama.cpp's token types (llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The regexes llama.cpp uses for each `tokenizer.ggml.pre` value, as Hugging Face writes them.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# Names llama.cpp gives Llama 3's rules (src/llama-vocab.cpp): its regex, a word the vocabulary
# holds whole taken whole before any merge (`ignore_merges`, as Llama 3's tokenizer.json sets
# it), and a BOS unless the file says otherwise.
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")
# Qwen2's rules (its regex, NFC-normalised text), and DeepSeek-R1-Distill-Qwen's name for them.
_QWEN2_NAMES = ("qwen2", "deepseek-r1-qwen")
_PRE_TOKENIZERS = {
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    # SmolLM: every digit on its own, then GPT-2's rules (checked against llama.cpp's ids).
    "smollm": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    ),
    **{name: lambda: _split_then_bytes(_LLAMA3_REGEX) for name in _LLAMA3_NAMES},
    **{name: lambda: _split_then_bytes(_QWEN2_REGEX) for name in _QWEN2_NAMES},
}

# Tokens that end generation wherever a vocabulary holds them, beside the eos, eot and eom ids
# the file names: llama.cpp's list (it finds them by their text, since converted files seldom
# name them), and what these models' own generation configs list (Llama 3.1's <|eom_id|> and
# <|end_of_text|>, Qwen's <|endoftext|>).
END_OF_GENERATION = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
    "<EOT>",
    "_<EOT>",
    "<end_of_utterance>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek's
)


@dataclass(frozen=True)
class TokenizerFiles:
    """What a Hugging Face folder's tokenizer files would hold."""

    tokenizer: tokenizers.Tokenizer
    tokenizer_config: dict[str, Any]  # tokenizer_config.json
    generation_config: dict[str, Any]  # generation_config.json


def tokenizer_files(file: GGUFFile) -> TokenizerFiles:
    """Rebuild the tokenizer of a GGUF file (`gpt2` byte-level BPE or `llama` SentencePiece)."""
    kind = file.string("tokenizer.ggml.model")
    tokens = _string_list(file, "tokenizer.ggml.tokens")
    types = file.value("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise MalformedModelFile(
            file.path,
            f"tokenizer.ggml.token_type has {len(types)} entries, tokens has {len(tokens)}",
        )
    ids = {
        role: file.optional_id(f"tokenizer.ggml.{role}_token_id", len(tokens))
        for role in ("bos", "eos", "unknown", "padding", "eot", "eom")
    }
    if kind == "gpt2":
        pre = file.string("tokenizer.ggml.pre", "gpt-2")
        tokenizer = _byte_level_bpe(file, tokens, pre)
        add_bos = file.boolean("tokenizer.ggml.add_bos_token", pre in _LLAMA3_NAMES)
    elif kind == "llama":
        unk = ids["unknown"]
        tokenizer = _sentencepiece_bpe(file, tokens, types, None if unk is None else tokens[unk])
        add_bos = file.boolean("tokenizer.ggml.add_bos_token", True)
    else:
        raise UnsupportedModel(
            file.path, f"tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, llama)"
        )
    tokenizer.add_tokens(
        [
            tokenizers.AddedToken(token, special=token_type == CONTROL, normalized=False)
            for token, token_type in zip(tokens, types, strict=True)
            if token_type in (CONTROL, USER_DEFINED)
        ]
    )
    bos = None if ids["bos"] is None else tokens[ids["bos"]]
    if add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, ids["bos"])],
        )
    named = [i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None]
    spelled = [i for i, token in enumerate(tokens) if token in END_OF_GENERATION]
    eos_ids = list(dict.fromkeys([*named, *spelled]))
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
    }
    for key, role in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        if ids[role] is not None:
            tokenizer_config[f"{key}_token"] = tokens[ids[role]]
    if file.has("tokenizer.chat_template"):
        tokenizer_config["chat_template"] = file.string("tokenizer.chat_template")
    generation_config: dict[str, Any] = {}
    if ids["bos"] is not None:
        generation_config["bos_token_id"] = ids["bos"]
    if eos_ids:
        generation_config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if ids["padding"] is not None:
        generation_config["pad_token_id"] = ids["padding"]
    return TokenizerFiles(tokenizer, tokenizer_config, generation_config)


def _string_list(file: GGUFFile, key: str) -> list[str]:
    value = file.value(key)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise MalformedModelFile(file.path, f"metadata {key!r} must be a list of strings")
    return value


def _byte_level_bpe(file: GGUFFile, tokens: list[str], pre: str) -> tokenizers.Tokenizer:
    """GPT-2 style BPE over bytes mapped to printable characters, with merges from the file,
    split as pre-tokeniser `pre` (`tokenizer.ggml.pre`) says."""
    if pre not in _PRE_TOKENIZERS:
        supported = ", ".join(_PRE_TOKENIZERS)
        raise UnsupportedModel(
            file.path, f"tokenizer.ggml.pre {pre!r} is not supported (supported: {supported})"
        )
    merges = []
    for merge in _string_list(file, "tokenizer.ggml.merges"):
        left, space, right = merge.partition(" ")
        if not space:
            raise MalformedModelFile(file.path, f"merge {merge!r} is not two tokens")
        merges.append((left, right))
    vocab = {token: index for index, token in enumerate(tokens)}
    try:
        model = models.BPE(vocab, merges, ignore_merges=pre in _LLAMA3_NAMES)
    except Exception as error:  # tokenizers raises a bare Exception (a merge of no token)
        raise MalformedModelFile(file.path, f"tokenizer.ggml.merges: {error}") from error
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    if pre in _QWEN2_NAMES:
        tokenizer.normalizer = normalizers.NFC()
    return tokenizer


def _sentencepiece_bpe(
    file: GGUFFile, tokens: list[str], types: list[int], unk: str | None
) -> tokenizers.Tokenizer:
    """A SentencePiece BPE vocabulary (Llama 2, Mistral, TinyLlama) as a `tokenizers` BPE.

    SentencePiece merges the adjacent pair whose union scores highest; BPE merges the pair of
    lowest rank. Ranking every (left, right) split of each vocabulary piece by the piece's
    score makes the two the same. Unknown bytes fall back to the `<0xNN>` tokens.
    """
    scores = file.value("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise MalformedModelFile(file.path, "tokenizer.ggml.scores must give one score per token")
    vocab = {token: index for index, token in enumerate(tokens)}
    ranked = []
    for index, (piece, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], index, vocab[left], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    tokenizer = tokenizers.Tokenizer(
        models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    add_space = file.boolean("tokenizer.ggml.add_space_prefix", True)
    replace = normalizers.Replace(" ", "\u2581")
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if add_space else replace
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer
