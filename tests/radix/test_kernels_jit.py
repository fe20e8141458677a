"""The kernels compile once per set of constexprs: the arguments that change from step to step (table
and ring-row widths, split counts, small index tensors at arbitrary offsets, an extend's token count)
are not specialized.

Read from the compiled (not interpreted) JIT functions, in a child process without TRITON_INTERPRET:
a name given to `jit_unspecialized` that is not a parameter would be ignored by Triton silently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kvstrata

CHILD = """
import json
from kvstrata.radix.kernels import attend, decode, decode4, extend, page_quantize
out = {}
kernels = {
    "_attend_kernel": attend._attend_kernel,
    "_extend_kernel": attend._extend_kernel,
    "_flash_extend_kernel": extend._flash_extend_kernel,
    "_decode_kernel": decode._decode_kernel,
    "_decode4_kernel": decode4._decode4_kernel,
    "_merge_kernel": attend._merge_kernel,
    "_dequant_kernel": attend._dequant_kernel,
    "_page_quantize_kernel": page_quantize._page_quantize_kernel,
}
for name, fn in kernels.items():
    out[name] = {
        "ints": sorted(p.name for p in fn.params if p.do_not_specialize),
        "pointers": sorted(p.name for p in fn.params if p.do_not_specialize_on_alignment),
    }
print(json.dumps(out))
"""


def test_step_varying_arguments_are_not_specialized():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(kvstrata.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    attention = {
        "ints": sorted(["pt_stride", "rr_stride", "pages_per_split", "num_splits", "tail_split"]),
        "pointers": sorted(["PT", "COLD_LEN", "ST", "SINK_OK", "RR", "RING_LEN"]),
    }
    assert got == {
        "_attend_kernel": attention,
        # the extend launches' copy: T (new tokens a sequence) varies from chunk to chunk too
        "_extend_kernel": {**attention, "ints": sorted([*attention["ints"], "T"])},
        "_flash_extend_kernel": {**attention, "ints": sorted([*attention["ints"], "T"])},
        # and the split counters, or an index tensor of the step where the kernel does not merge
        "_decode_kernel": {**attention, "pointers": sorted([*attention["pointers"], "COUNT"])},
        "_decode4_kernel": {**attention, "pointers": sorted([*attention["pointers"], "COUNT"])},
        "_merge_kernel": {"ints": ["num_splits"], "pointers": []},
        "_dequant_kernel": {"ints": [], "pointers": ["PT"]},
        # and the step's page and new-row counts (the ring rows it writes where `ring_rows_fused`)
        "_page_quantize_kernel": {
            "ints": ["n_pages", "n_rows"],
            "pointers": sorted(["SRC", "PAGE_IDS", "SINK_SLOTS", "RING_DST", "RING_SRC"]),
        },
    }
