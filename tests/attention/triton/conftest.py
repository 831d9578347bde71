"""Kernel tests run on the GPU when there is one, else on the CPU under Triton's interpreter.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, so it must be set before
``pagedkv.model.triton_*`` is first imported: pytest loads this file before the test modules
next to it.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    """Where the kernels run: the GPU, or the CPU through the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _patch_interpreter_bf16_dot() -> None:
    """Make the interpreter's ``tl.dot`` read bf16 operands as numbers.

    Triton 3.9's interpreter keeps bf16 values as raw uint16 bits and its ``create_dot``
    multiplies those bits as integers (it converts only fp8), so any bf16 ``tl.dot`` returns
    garbage there; compiled kernels are unaffected. Widening bf16 operands to float32 first
    gives what the GPU's tensor cores compute: exact products, float32 sums.
    """
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpreterBuilder
    except ImportError:
        return
    create_dot = InterpreterBuilder.create_dot

    def create_dot_bf16_as_f32(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    InterpreterBuilder.create_dot = create_dot_bf16_as_f32


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_bf16_dot()
