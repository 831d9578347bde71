"""A 1B-class model for the benchmarks: TinyLlama-1.1B's shape, seeded random weights, as GGUF.

22 layers, hidden 2048, MLP 5632, 32 heads, 4 KV heads (TinyLlama-1.1B's shape); its
vocabulary and tokenizer are the built-in model's (49,152 tokens, a real BPE both engines
read) rather than TinyLlama's 32,000, which no file here carries. Weights are drawn N(0, 0.02)
from a seeded generator, the norms are ones; every 2-D weight is stored in the chosen block
type (gguf-py's quantiser), the norms as float32. The file is written once per type into the
cache (`pagedkv.hub.cache_dir() / "bench"`), ~0.6-1.2 GB, and reused.

Run: .venv/bin/python -m pagedkv.bench.model_1b --qtype Q4_1   (prints the file's path)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from pagedkv.hub import DEFAULT_MODEL, cache_dir, pull
from pagedkv.weights.gguf.file import GGUFFile

SHAPE = {
    "block_count": 22,
    "embedding_length": 2048,
    "feed_forward_length": 5632,
    "attention.head_count": 32,
    "attention.head_count_kv": 4,
    "context_length": 2048,
    "rope.freq_base": 10000.0,
    "attention.layer_norm_rms_epsilon": 1e-5,
}
QTYPES = ("Q4_0", "Q4_1", "Q8_0")
SEED = 0
INIT_STD = 0.02


def model_1b_path(qtype: str = "Q4_1") -> Path:
    """The cached file of the 1B-shape model in `qtype`, written on first use."""
    path = cache_dir() / "bench" / f"tinyllama-1.1b-shape-{qtype.lower()}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_model_1b(partial, QType[qtype])
        partial.replace(path)  # a file at `path` is always complete
    return path


def write_model_1b(path: Path, qtype: QType, shape: dict[str, int | float] = SHAPE) -> None:
    """Write the model: the built-in model's tokenizer keys, `shape` (the 1B one; tests give a
    small one), random weights."""
    source = GGUFFile(pull(DEFAULT_MODEL, progress=lambda line: None))
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tinyllama-1.1b-shape-random")
    for key, value in shape.items():
        if isinstance(value, float):
            writer.add_float32(f"llama.{key}", value)
        else:
            writer.add_uint32(f"llama.{key}", value)
    hidden, heads = int(shape["embedding_length"]), int(shape["attention.head_count"])
    writer.add_uint32("llama.rope.dimension_count", hidden // heads)
    for key, value in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, list):  # tokens and merges (strings), token types (int32)
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    vocab_size = len(source.fields["tokenizer.ggml.tokens"])
    writer.add_uint32("llama.vocab_size", vocab_size)
    generator = np.random.default_rng(SEED)
    ffn = int(shape["feed_forward_length"])
    kv = hidden // heads * int(shape["attention.head_count_kv"])

    def matrix(name: str, rows: int, cols: int) -> None:
        weight = generator.standard_normal((rows, cols), dtype=np.float32) * INIT_STD
        writer.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(hidden, dtype=np.float32))

    matrix("token_embd.weight", vocab_size, hidden)
    for layer in range(int(shape["block_count"])):
        prefix = f"blk.{layer}."
        norm(prefix + "attn_norm.weight")
        for name, rows in (("attn_q", hidden), ("attn_k", kv), ("attn_v", kv)):
            matrix(prefix + name + ".weight", rows, hidden)
        matrix(prefix + "attn_output.weight", hidden, hidden)
        norm(prefix + "ffn_norm.weight")
        matrix(prefix + "ffn_gate.weight", ffn, hidden)
        matrix(prefix + "ffn_up.weight", ffn, hidden)
        matrix(prefix + "ffn_down.weight", hidden, ffn)
    norm("output_norm.weight")
    matrix("output.weight", vocab_size, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qtype", choices=QTYPES, default="Q4_1")
    args = parser.parse_args()
    print(model_1b_path(args.qtype), file=sys.stdout)


if __name__ == "__main__":
    main()
