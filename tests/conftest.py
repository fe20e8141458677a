"""Without CUDA the Triton kernels run under the interpreter, in every test module alike.

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel module is imported: set later, the kernels
imported before stay compiled-only and the interpreted ones fail calling them ("Cannot call
@triton.jit'd outside of the scope of a kernel"). Test modules that run kernels set it at import, so
whether a suite passed depended on which module pytest collected first (e.g. `tests/engine/
test_memory_plan.py` before `tests/multimodal/test_vlm_triton.py` failed). Set here, it holds before
any test module is imported."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
