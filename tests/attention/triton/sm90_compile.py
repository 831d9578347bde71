"""Compile the Triton kernels for sm_90 (H100/H200) on a machine with no GPU, and report them.

The interpreter runs kernels as numpy, so it accepts code the GPU compiler rejects and never
shows register spills. This module compiles the launches the wrappers really make: each
kernel is swapped for a recorder, the wrappers run on meta tensors (no memory, no launch), and
every recorded launch goes through Triton's compiler and bundled ptxas for sm_90, with the
argument specialisation (16-byte divisibility) a real launch gets. It prints registers, stack
(spilled) bytes and shared memory per kernel.

Run it with ``TRITON_INTERPRET`` unset (interpreted kernels cannot be compiled):
``python -m tests.attention.triton.sm90_compile [bfloat16] [float32] [bfloat16:fp8_e4m3]``
(``model dtype:KV cache dtype`` for an fp8 cache).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedkv.attention.fp8 import FP8_DTYPES
from pagedkv.attention.triton import attention as triton_attention
from pagedkv.attention.triton import kv as triton_kv

SM90 = GPUTarget("cuda", 90, 32)
_POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.uint8: "*u8",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.float8_e5m2: "*fp8e5",
}
_KERNELS = {
    triton_attention: ("_decode_kernel", "_merge_partitions_kernel", "_prefill_kernel"),
    triton_kv: ("_write_kv_kernel",),
}


@dataclass(frozen=True)
class Launch:
    """One kernel launch as a wrapper made it."""

    kernel: Any  # the JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Resources:
    """What ptxas reports for one compiled kernel."""

    name: str
    registers: int
    stack_bytes: int  # local memory per thread: spilled registers
    shared_bytes: int  # dynamic shared memory per program
    matrix_instruction: str  # wgmma (Hopper), mma.sync (Ampere-style) or none

    def __str__(self) -> str:
        return (
            f"{self.name:<25} registers {self.registers:>3}  stack {self.stack_bytes:>4} B  "
            f"shared {self.shared_bytes:>6} B  {self.matrix_instruction}"
        )


@contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Within the block, the wrappers record their launches instead of running them."""
    launches: list[Launch] = []

    def recorder(kernel: Any) -> Any:
        class Recorder:
            def __getitem__(self, grid: Any) -> Callable[..., None]:
                return lambda *args, **kwargs: launches.append(Launch(kernel, args, kwargs))

        return Recorder()

    with ExitStack() as patches:
        for module, names in _KERNELS.items():
            for name in names:
                patches.enter_context(
                    mock.patch.object(module, name, recorder(getattr(module, name)))
                )
        yield launches


def compile_for_sm90(launch: Launch) -> Resources:
    """Compile one recorded launch to a cubin and read its resource usage."""
    kernel, kwargs = launch.kernel, dict(launch.kwargs)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    values = dict(zip(kernel.arg_names, launch.args, strict=False)) | kwargs
    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        value = values[name]
        if name in kwargs:
            signature[name] = "constexpr"
        elif isinstance(value, torch.Tensor):
            signature[name] = _POINTER_TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]  # allocations are 256-byte aligned
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, kwargs, attrs)
    compiled = triton.compile(source, target=SM90, options=options)
    registers, stack_bytes = _resource_usage(compiled.asm["cubin"])
    ptx = compiled.asm["ptx"]
    matrix = next((op for op in ("wgmma", "mma.sync") if op in ptx), "none")
    return Resources(kernel.__name__, registers, stack_bytes, compiled.metadata.shared, matrix)


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) per thread from cuobjdump's report."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", file.name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    fields = dict(re.findall(r"(REG|STACK):(\d+)", report))
    return int(fields["REG"]), int(fields["STACK"])


def serving_launches(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> list[Launch]:
    """The launches of one Llama-8B-shaped layer (32 heads, 8 KV heads, head_dim 128), its
    cache in `kv_dtype` (default: `dtype`)."""
    meta = torch.device("meta")
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    cache_dtype = kv_dtype or dtype
    k_cache = torch.empty(4096, block_size, num_kv_heads, head_dim, dtype=cache_dtype, device=meta)
    v_cache = torch.empty_like(k_cache)
    with recorded_launches() as launches:
        for num_seqs, num_tokens, max_query_len, max_context_len in (
            (64, 64, 1, 4096),  # decode, split into partitions and merged
            (64, 64, 1, 300),  # decode, one partition
            (4, 1000, 512, 700),  # prefill
        ):
            query = torch.empty(num_tokens, num_heads, head_dim, dtype=dtype, device=meta)
            lens = torch.empty(num_seqs, dtype=torch.int32, device=meta)
            tables = torch.empty(num_seqs, 4096 // block_size, dtype=torch.int32, device=meta)
            triton_attention.triton_paged_attention(
                query,
                k_cache,
                v_cache,
                tables,
                lens,
                torch.empty(num_seqs + 1, dtype=torch.int32, device=meta),
                max_query_len,
                max_context_len,
                head_dim**-0.5,
            )
        key = torch.empty(64, num_kv_heads, head_dim, dtype=dtype, device=meta)
        slots = torch.empty(64, dtype=torch.int64, device=meta)
        triton_kv.triton_write_kv(key, key, k_cache, v_cache, slots)
    return launches


def main() -> None:
    """Compile every serving launch in the dtypes named (default: bf16 float32); a name
    `model:kv` (bfloat16:fp8_e4m3) gives the cache an fp8 dtype."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dtypes", nargs="*", default=["bfloat16", "float32"])
    for name in parser.parse_args().dtypes:
        model_dtype, _, kv_name = name.partition(":")
        print(f"{name}:")
        kv_dtype = FP8_DTYPES[kv_name] if kv_name else None
        for launch in serving_launches(getattr(torch, model_dtype), kv_dtype):
            print(f"  {compile_for_sm90(launch)}", flush=True)


if __name__ == "__main__":
    main()
