"""The Triton kernel variants a piece of work launches, recorded on CPU under ``TRITON_INTERPRET=1``.

A GPU compiles one variant of a kernel per key: its constexprs and launch options (``num_warps``,
``maxnreg``, ...) and the specialization of its other arguments (a tensor's dtype and 16-byte
alignment, an integer's being 1 or a multiple of 16 and its width), except the arguments the kernel
leaves unspecialized (`kvstrata.radix.kernels.jit`). The interpreter compiles nothing, but every
launch goes through `InterpretedFunction.run`, where `record_variants` writes down that key.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction

Variant = tuple[str, tuple[tuple[str, str], ...]]


def _spec(value: Any, unspecialized: bool, any_alignment: bool) -> str:
    """The part of Triton's specialization key one runtime argument contributes."""
    if isinstance(value, torch.Tensor):
        aligned = any_alignment or value.data_ptr() % 16 == 0
        return f"{value.dtype}{'' if aligned else ' unaligned'}"
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        width = "i32" if -(2**31) <= value < 2**31 else "i64"
        if unspecialized:
            return width
        return "1" if value == 1 else f"{width} %16" if value % 16 == 0 else width
    return type(value).__name__


def variant(fn: InterpretedFunction, args: tuple, kwargs: dict[str, Any]) -> Variant:
    """``(kernel name, sorted (argument, key part))`` of one launch."""
    ints = set(fn.kwargs.get("do_not_specialize") or ())
    pointers = set(fn.kwargs.get("do_not_specialize_on_alignment") or ())
    named = zip(fn.arg_names, args, strict=False)
    parts = {name: _spec(a, name in ints, name in pointers) for name, a in named}
    # keyword arguments: constexprs and launch options by value, tensors (a runtime argument given by
    # keyword) by their specialization
    parts.update(
        (name, _spec(value, False, name in pointers) if isinstance(value, torch.Tensor) else repr(value))
        for name, value in kwargs.items()
    )
    return f"{fn.fn.__module__}.{fn.fn.__name__}", tuple(sorted(parts.items()))


@contextlib.contextmanager
def record_variants(execute: bool = True) -> Iterator[set[Variant]]:
    """Within the block, every interpreted kernel launch adds its `variant` to the yielded set.
    ``execute`` False: the kernels do not run (their outputs keep what the tensors held), for
    workloads that need only the launches of a step, not its numbers."""
    seen: set[Variant] = set()
    run = InterpretedFunction.run

    def recording(self: InterpretedFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        seen.add(variant(self, args, kwargs))
        if not execute:
            return None
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        InterpretedFunction.run = run  # type: ignore[method-assign]
