"""The CPU kernels in C, compiled once per machine: the matmuls (`qmatmul.c`, `fmatmul.c`),
paged attention (`attention.c`), the per-row steps (`rowwise.c`, `rope_kv.c`) and the fused
decode layers (`decode_layer.c`), with their shared helpers (`simd.h`).

They exist for two reasons. Speed: PyTorch 2.13's CPU build has no fast 4-bit or int8
weight-only matmul on AVX2 machines (its `_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm`
fall back to scalar loops there: 5-7x slower than float32 at batch 1,
measured on a 2-core AMD EPYC), and attention over paged blocks is a dozen small ops per layer in
torch. And one answer per request: every kernel computes a row with one fixed order of float
operations, whatever the other rows of the call, the chunking or the thread count, where BLAS
changes its blocking with the row count and a vectorised exp differs from its scalar tail.

Small C files, built with the system's C compiler into the cache folder the first time they
are needed (a few seconds), keyed by the sources, the compiler and this CPU, and loaded with
ctypes. Linking with `-fopenmp` binds them to the OpenMP runtime torch has already loaded, so
both share one thread pool. Without a C compiler, `kernels()` returns None and the model runs
on torch ops (correct, slower, and not batch-invariant); `unavailable_reason()` says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pagedkv.hub import cache_dir

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "qmatmul.c",
        "fmatmul.c",
        "attention.c",
        "rowwise.c",
        "rope_kv.c",
        "decode_layer.c",
        "lora.c",
    )
)
HEADERS = (Path(__file__).with_name("simd.h"),)
# -ffp-contract=off: `a * b + c` stays two roundings unless a kernel asks for an fma, so the
# order of every float operation is the source's, on any compiler.
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c11")
# What the kernels are compiled for: this CPU, unless PAGEDKV_MARCH names another target
# (`haswell` builds the AVX2 path on an AVX-512 machine, `x86-64` the plain C one).
MARCH_VARIABLE = "PAGEDKV_MARCH"
_QMATMUL_ARGS = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # x, m, k
    + [ctypes.c_void_p] * 3  # values, scales, mins
    + [ctypes.c_int, ctypes.c_int, ctypes.c_int]  # half (float16 scales and mins), has_mins, bits
    + [ctypes.c_int64, ctypes.c_int64]  # g, n
    + [ctypes.c_void_p, ctypes.c_void_p]  # bias, y
)
_QMATMUL_PANELS_ARGS = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # x, m, k
    + [ctypes.c_void_p] * 3  # values, scales, mins (panel layout)
    + [ctypes.c_int, ctypes.c_int, ctypes.c_int]  # half, has_mins, bits
    + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]  # n, bias, y
)
_DEQUANTIZE_ARGS = (
    [ctypes.c_void_p] * 3  # values, scales, mins
    + [ctypes.c_int, ctypes.c_int]  # half, bits
    + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]  # g, n, k
    + [ctypes.c_void_p]  # out
)
_DEQUANTIZE_ROWS_ARGS = (
    [ctypes.c_void_p] * 3  # values, scales, mins
    + [ctypes.c_int, ctypes.c_int]  # half, bits
    + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]  # g, n, k
    + [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]  # panels, row_stride, group_stride
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]  # index, count, out
)
_FMATMUL_ARGS = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # x, m, k
    + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]  # w, w_dtype, n
    + [ctypes.c_void_p, ctypes.c_void_p]  # bias, y
)
_LORA_ADD_ARGS = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]  # x, k, groups
    + [ctypes.c_int64, ctypes.c_void_p]  # num_parts, part_sizes
    + [ctypes.c_void_p, ctypes.c_int64]  # out, out_stride
)
_ATTENTION_ARGS = (
    [ctypes.c_void_p, ctypes.c_int64]  # q, q_stride
    + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]  # k_cache, v_cache, cache_dtype
    + [ctypes.c_void_p, ctypes.c_float, ctypes.c_float]  # fp8_table, k_scale, v_scale
    + [ctypes.c_void_p, ctypes.c_int64]  # block_tables, table_stride
    + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]  # query_starts, context_lens, num_seqs
    + [ctypes.c_int64] * 4  # num_heads, num_kv_heads, head_dim, block_size
    + [ctypes.c_float, ctypes.c_int64]  # scale, window
    + [ctypes.c_void_p]  # out
)
_ROPE_TABLES_ARGS = (
    [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
    ]  # positions, n, inv_freq, half
    + [ctypes.c_void_p, ctypes.c_void_p]  # cos, sin
)
_SILU_MUL_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
_ROPE_ARGS = (
    [ctypes.c_void_p]
    + [ctypes.c_int64] * 4  # x, num_tokens, row_stride, num_heads, head_dim
    + [ctypes.c_void_p, ctypes.c_void_p]  # cos, sin
)


class QuantizedWeightArgs(ctypes.Structure):
    """decode_layer.c's `QuantizedWeight`: one quantised projection's arrays and sizes."""

    _fields_ = [
        ("values", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("half_scales", ctypes.c_int64),
        ("has_mins", ctypes.c_int64),
        ("bits", ctypes.c_int64),
        ("group_size", ctypes.c_int64),
        ("out_features", ctypes.c_int64),
        ("in_features", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
        ("panels", ctypes.c_int64),  # 1: values, scales and mins in the panel layout
    ]


class LoRAPartArgs(ctypes.Structure):
    """lora.c's `LoRAPart`: one adapted part of a projection."""

    _fields_ = [
        ("b_t", ctypes.c_void_p),
        ("rank", ctypes.c_int64),
        ("rank_offset", ctypes.c_int64),
        ("index", ctypes.c_int64),
        ("scaling", ctypes.c_float),
    ]


class Fp8CacheArgs(ctypes.Structure):
    """decode_layer.c's `Fp8Cache`: an fp8 cache's byte table, bit layout and scales."""

    _fields_ = [
        ("table", ctypes.c_void_p),
        ("mantissa_bits", ctypes.c_int64),
        ("exponent_bias", ctypes.c_int64),
        ("max", ctypes.c_float),
        ("k_scale", ctypes.c_float),
        ("v_scale", ctypes.c_float),
        ("k_inverse_scale", ctypes.c_float),
        ("v_inverse_scale", ctypes.c_float),
    ]


class DecodeLayerArgs(ctypes.Structure):
    """decode_layer.c's `DecodeLayer`: one layer's norms, projections, caches and window."""

    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("weights", QuantizedWeightArgs * 4),  # qkv, o, gate_up, down
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("window", ctypes.c_int64),
        ("fp8", ctypes.POINTER(Fp8CacheArgs)),  # NULL: float32 caches
    ]


_DECODE_LAYERS_ARGS = (
    [ctypes.c_void_p]
    + [ctypes.c_int64] * 3  # hidden, m, hidden_size, num_layers
    + [ctypes.POINTER(DecodeLayerArgs)]
    + [ctypes.c_int64] * 3  # num_heads, num_kv_heads, head_dim
    + [ctypes.c_void_p] * 4  # cos, sin, slots, block_tables
    + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]  # table_stride, query_starts, lens
    + [ctypes.c_int64, ctypes.c_int64, ctypes.c_float]  # num_seqs, block_size, scale
    + [ctypes.c_void_p, ctypes.c_int64]  # LoRA groups per layer and projection (or NULL), count
)
_RMS_NORM_ARGS = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]  # x, stride, rows, cols
    + [ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p]  # weight (or NULL), eps, out
)
_WRITE_KV_ARGS = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]  # k, stride, v, stride
    + [ctypes.c_int64, ctypes.c_int64]  # num_tokens, width
    + [ctypes.c_void_p] * 3  # slots, k_cache, v_cache
)
_WRITE_KV_FP8_ARGS = _WRITE_KV_ARGS + (
    [ctypes.c_int64, ctypes.c_int64, ctypes.c_float]  # mantissa_bits, bias, max
    + [ctypes.c_float, ctypes.c_float]  # k_inverse_scale, v_inverse_scale
)


# pagedkv_vector_path()'s answer, in words.
VECTOR_PATHS = ("plain C", "AVX2", "AVX2 + AVX-512 VNNI")


class KernelBuildError(RuntimeError):
    """The C compiler could not build the quantised matmul kernel."""


@dataclass(frozen=True)
class Kernels:
    """The library's entry points, typed for ctypes."""

    qmatmul: ctypes._CFuncPtr  # quantised weights: int8 dot products, any row count
    qmatmul_panels: ctypes._CFuncPtr  # the same for weights in the panel layout
    dequantize: ctypes._CFuncPtr  # a quantised weight to float32
    dequantize_rows: ctypes._CFuncPtr  # some of its rows (an embedding lookup)
    fmatmul: ctypes._CFuncPtr  # float32/bfloat16/float16 weights
    attention: ctypes._CFuncPtr  # every query row over its sequence's paged keys
    rope: ctypes._CFuncPtr  # rotary embedding in place
    rope_tables: ctypes._CFuncPtr  # its cos and sin per position
    write_kv: ctypes._CFuncPtr  # new keys and values into their cache slots
    write_kv_fp8: ctypes._CFuncPtr  # the same, rounded into fp8 bytes
    rms_norm: ctypes._CFuncPtr  # RMSNorm of float32 rows
    silu_mul: ctypes._CFuncPtr  # SwiGLU's silu(gate) * up
    decode_layers: ctypes._CFuncPtr  # consecutive decoder layers of a step, in one call
    lora_add: ctypes._CFuncPtr  # a mixed batch's LoRA products, added to a projection's output
    vector_path: str  # the instructions this build computes with (VECTOR_PATHS)

    @property
    def panels(self) -> bool:
        """Whether this build multiplies weights in the panel layout (AVX-512 VNNI)."""
        return self.vector_path == VECTOR_PATHS[2]


@functools.cache
def kernels() -> Kernels | None:
    """The compiled kernels, building them on first use; None if that is impossible."""
    try:
        library = ctypes.CDLL(str(build()))
    except (KernelBuildError, OSError):
        return None
    library.pagedkv_qmatmul.argtypes = _QMATMUL_ARGS
    library.pagedkv_qmatmul.restype = ctypes.c_int
    library.pagedkv_qmatmul_panels.argtypes = _QMATMUL_PANELS_ARGS
    library.pagedkv_qmatmul_panels.restype = ctypes.c_int
    library.pagedkv_dequantize.argtypes = _DEQUANTIZE_ARGS
    library.pagedkv_dequantize.restype = None
    library.pagedkv_dequantize_rows.argtypes = _DEQUANTIZE_ROWS_ARGS
    library.pagedkv_dequantize_rows.restype = ctypes.c_int
    library.pagedkv_fmatmul.argtypes = _FMATMUL_ARGS
    library.pagedkv_fmatmul.restype = ctypes.c_int
    library.pagedkv_attention.argtypes = _ATTENTION_ARGS
    library.pagedkv_attention.restype = ctypes.c_int
    library.pagedkv_rope.argtypes = _ROPE_ARGS
    library.pagedkv_rope.restype = None
    library.pagedkv_rope_tables.argtypes = _ROPE_TABLES_ARGS
    library.pagedkv_rope_tables.restype = None
    library.pagedkv_silu_mul.argtypes = _SILU_MUL_ARGS
    library.pagedkv_silu_mul.restype = None
    library.pagedkv_vector_path.argtypes = []
    library.pagedkv_vector_path.restype = ctypes.c_int
    library.pagedkv_write_kv.argtypes = _WRITE_KV_ARGS
    library.pagedkv_write_kv.restype = None
    library.pagedkv_write_kv_fp8.argtypes = _WRITE_KV_FP8_ARGS
    library.pagedkv_write_kv_fp8.restype = None
    library.pagedkv_rms_norm.argtypes = _RMS_NORM_ARGS
    library.pagedkv_rms_norm.restype = None
    library.pagedkv_decode_layers.argtypes = _DECODE_LAYERS_ARGS
    library.pagedkv_decode_layers.restype = ctypes.c_int
    library.pagedkv_lora_add.argtypes = _LORA_ADD_ARGS
    library.pagedkv_lora_add.restype = ctypes.c_int
    return Kernels(
        library.pagedkv_qmatmul,
        library.pagedkv_qmatmul_panels,
        library.pagedkv_dequantize,
        library.pagedkv_dequantize_rows,
        library.pagedkv_fmatmul,
        library.pagedkv_attention,
        library.pagedkv_rope,
        library.pagedkv_rope_tables,
        library.pagedkv_write_kv,
        library.pagedkv_write_kv_fp8,
        library.pagedkv_rms_norm,
        library.pagedkv_silu_mul,
        library.pagedkv_decode_layers,
        library.pagedkv_lora_add,
        VECTOR_PATHS[library.pagedkv_vector_path()],
    )


def cpu_kernels(*tensors) -> Kernels | None:
    """The kernels for an op over `tensors` when they all lie in CPU memory, else None (torch
    computes it): the one rule by which every op chooses between C and torch. It is asked per
    call because the C code reads raw addresses and a module may be moved after it was built
    (to `meta`, say); the build itself is decided once per process (`kernels`)."""
    return kernels() if all(t.device.type == "cpu" for t in tensors) else None


def heads_packed(x) -> bool:
    """Whether `x` `[tokens, heads, head_dim]` has its heads packed within each row (rows
    may be strided, as q/k/v views of one fused projection are): how the kernels read it."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def unavailable_reason() -> str | None:
    """Why `kernels()` is None (the compiler's complaint), or None when the kernel loads."""
    try:
        ctypes.CDLL(str(build()))
    except (KernelBuildError, OSError) as error:
        return str(error)
    return None


def build() -> Path:
    """The shared library for this source, compiler and CPU, compiled into the cache once."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelBuildError("no C compiler found (set CC, or install gcc)")
    flags = (*FLAGS, f"-march={os.environ.get(MARCH_VARIABLE) or 'native'}")
    key = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        key.update(source.read_bytes())
    key.update(" ".join((compiler, *flags, _compiler_version(compiler), _cpu())).encode())
    target = cache_dir() / "kernels" / f"pagedkv-cpu-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: a concurrent or interrupted build never leaves a
    # half-written library under the final name.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        command = [compiler, *flags, *map(str, SOURCES), "-o", str(partial), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise KernelBuildError(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
        partial.replace(target)
    return target


def _compiler_version(compiler: str) -> str:
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    except OSError as error:
        raise KernelBuildError(f"cannot run {compiler}: {error}") from error
    return result.stdout


def _cpu() -> str:
    """What `-march=native` compiles for: the machine and, on Linux, its CPU flags."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        lines = cpuinfo.read_text(errors="replace").splitlines()
        flags = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    return f"{platform.machine()} {flags}"
