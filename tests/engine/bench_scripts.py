"""Run a script of `benchmarks/` on the CPU from a test: the repository on PYTHONPATH, Triton's
interpreter off (the scripts run the torch backend there), its exit status checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kvstrata

ROOT = Path(kvstrata.__file__).resolve().parents[1]


def run_benchmark(script: str, *args: str) -> str:
    """``python benchmarks/<script> <args>`` from the repository root; fails the test on a non-zero exit,
    else returns what it printed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
