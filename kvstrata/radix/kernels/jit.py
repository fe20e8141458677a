"""`triton.jit` for kernels whose index arguments change from step to step.

Triton compiles one variant of a kernel per *specialization* of its arguments: every integer is
specialized on being 1 and on being a multiple of 16, every pointer on 16-byte alignment. The
attention and page-quantize kernels take per-step values (page-table and ring-row widths, pages per
split, split counts) and small index tensors that are views into one uploaded buffer at arbitrary
offsets, or ``[3, B]`` tables whose rows are 16-byte aligned only when B is a multiple of 4. Each new
combination compiled a new variant (seconds each on the GPU) in the middle of serving: on one H200 the
offline engine's mixed prefill + decode steps took about 1.1 s each (0.26 s once compiled) and its
decode steps at B=96 about 0.36 s (0.04 s) (benchmarks/prefill_gpu.py). Those arguments are left
unspecialized here, so a kernel compiles once per set of its constexprs (which the engine's warm-up
meets: `kvstrata/engine/warmup.py`). An extend's token count T too (`attend._extend_kernel`); decode
launches keep T specialized, the constant 1.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import triton


def jit_unspecialized(ints: Sequence[str] = (), pointers: Sequence[str] = ()) -> Callable[[Any], Any]:
    """``triton.jit`` with no value specialization of the integer arguments ``ints`` and no alignment
    specialization of the pointer arguments ``pointers`` (where this Triton supports it)."""
    kwargs: dict[str, Any] = {"do_not_specialize": list(ints)}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        kwargs["do_not_specialize_on_alignment"] = list(pointers)
    return triton.jit(**kwargs)
