"""read_gguf against `gguf.GGUFReader` (the format's reference reader) on files gguf writes.

Every metadata value type, arrays of each, and tensors of float, integer and block-quantised
types must read back as the reference reads them; broken files must fail with an error naming
the problem, never with a bare struct or numpy error.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from pagedkv.model.errors import MalformedModelFile, ModelFileMissing
from pagedkv.weights.gguf.file import GGUFFile
from pagedkv.weights.gguf.reader import read_gguf

TENSOR_TYPES = (QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_K, QType.Q6_K)


def _write(path, rng):
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**60)
    writer.add_int64("t.i64", -(2**60))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.strings", ["a", "", "ünï", "Ġthe"] * 50)
    writer.add_array("t.ints", list(range(-5, 300)))
    writer.add_array("t.floats", [0.5, -1.25, 3.0])
    writer.add_array("t.bools", [True, False, True])
    for index, qtype in enumerate(TENSOR_TYPES):
        values = rng.standard_normal((4, 256)).astype(np.float32)
        if qtype == QType.F32:
            data = values
        elif qtype == QType.F16:
            data = values.astype(np.float16)
        else:  # blocks of bytes; gguf cannot quantise k-quants, and the reader never decodes
            block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            data = rng.integers(0, 256, (4, 256 // block_values * block_bytes), dtype=np.uint8)
        writer.add_tensor(f"w{index}", data, raw_dtype=qtype)
    writer.add_tensor("vector", rng.standard_normal(7).astype(np.float32))
    writer.add_tensor("ids", np.arange(12, dtype=np.int32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    _write(path, np.random.default_rng(0))
    return path


def test_metadata_reads_as_the_reference_reads_it(gguf_file):
    reference = gguf.GGUFReader(gguf_file)
    # The reference also lists the header's counts as pseudo-fields "GGUF.version" etc.
    stored = {key: field for key, field in reference.fields.items() if not key.startswith("GGUF.")}
    fields = read_gguf(gguf_file).fields
    assert list(fields) == list(stored)
    for key, field in stored.items():
        assert fields[key] == field.contents(), key
    assert fields["t.str"] == "héllo ✓"
    assert fields["t.u64"] == 2**60


def test_tensors_are_views_equal_to_the_reference(gguf_file):
    reference = {tensor.name: tensor for tensor in gguf.GGUFReader(gguf_file).tensors}
    tensors = read_gguf(gguf_file).tensors
    assert list(tensors) == list(reference)
    for name, tensor in tensors.items():
        expected = reference[name]
        assert tensor.tensor_type == expected.tensor_type
        assert tensor.shape == tuple(int(n) for n in expected.shape)
        assert tensor.data.dtype == expected.data.dtype, name
        assert tensor.data.shape == expected.data.shape, name
        assert np.array_equal(tensor.data, expected.data), name
        assert not tensor.data.flags.writeable  # a view of the read-only mapping, not a copy


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda raw: b"GGML" + raw[4:], "magic"),
        (lambda raw: raw[:4] + (7).to_bytes(4, "little") + raw[8:], "version 7"),
        (lambda raw: raw[:4] + (3).to_bytes(4, "big") + raw[8:], "little-endian"),
        (lambda raw: raw[:200], "not a valid GGUF file"),
        (lambda raw: raw[:-100], "runs past the end of the file"),
        (lambda raw: b"", "not a valid GGUF file"),
    ],
)
def test_a_broken_file_names_its_problem(gguf_file, damage, message):
    gguf_file.write_bytes(damage(gguf_file.read_bytes()))
    with pytest.raises(MalformedModelFile, match=message):
        read_gguf(gguf_file)


def test_a_folder_or_a_missing_path_is_named_as_such(tmp_path):
    with pytest.raises(MalformedModelFile, match="is a folder, not a GGUF file"):
        GGUFFile(tmp_path)
    with pytest.raises(ModelFileMissing, match=r"nowhere\.gguf: missing \(the GGUF file\)"):
        GGUFFile(tmp_path / "nowhere.gguf")
