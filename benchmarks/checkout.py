"""A benchmark's ``--baseline``: the same script's measurement of another checkout of kvstrata, run in
a subprocess with that checkout first on ``PYTHONPATH`` (so both codes are measured in one run)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any


def measure_checkout(
    script: str,
    checkout: str,
    args: argparse.Namespace,
    options: tuple[str, ...],
    flags: tuple[str, ...] = (),
) -> Any:
    """``python script --json`` with ``args``' values of ``options`` (and its true ``flags``) under
    ``checkout``: the JSON the script prints last."""
    argv = [sys.executable, script, "--json"]
    for name in options:
        argv += [f"--{name}", str(getattr(args, name))]
    argv += [f"--{name}" for name in flags if getattr(args, name)]
    env = dict(os.environ, PYTHONPATH=checkout)
    done = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1])
