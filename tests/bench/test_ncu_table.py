"""`benchmarks/ncu_attention.py table`: Nsight Compute's raw CSV page read back into the kernel table."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("ncu_attention", ROOT / "benchmarks" / "ncu_attention.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


RAW = """==PROF== Connected to process 123
"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","launch__registers_per_thread",\
"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_selected_per_issue_active.ratio"
"","","nsecond","byte","register/thread","ratio","ratio","ratio","ratio"
"0","_decode_kernel","1,309,000","4,330,000,000","255","6.5","1.25","0","1"
"1","_merge_kernel","12,500","8,000,000","40","n/a","0.5","2","1"
"""


def test_raw_page_rows(tmp_path: Path) -> None:
    mod = _module()
    path = tmp_path / "fp8_e4m3_64_32768.csv"
    path.write_text(RAW)
    rows = mod.read_raw(path)
    assert [r["Kernel Name"] for r in rows] == ["_decode_kernel", "_merge_kernel"]  # units row skipped
    out = mod.table([("fp8_e4m3:64:32768", path), ("sdpa:1:1", tmp_path / "missing.csv")])
    lines = out.splitlines()
    decode = lines[2].split(" | ")
    assert decode[1] == "_decode_kernel"
    assert decode[2] == "1309"  # microseconds
    assert decode[3] == "4330"  # MB read
    assert decode[7] == "255"  # registers
    # largest first; zero stalls and "selected" (the issuing warp, not a stall) left out
    assert decode[-1].rstrip(" |") == "long_scoreboard 6.5, wait 1.25"
    assert lines[3].split(" | ")[-1].rstrip(" |") == "barrier 2, wait 0.5"  # "n/a" is no number
    assert "no kernel profiled" in lines[4]
