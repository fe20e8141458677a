"""Helpers shared by the deployment tests (a uniquely named module, so that it cannot clash with
another directory's helpers)."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
VENV_BIN = Path(sys.executable).parent
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for the fixtures' servers: the child gets SIGTERM when the test process dies, even
    by a signal that skips the fixtures' teardown (a killed `make test` used to leave `kvstrata serve`
    and Prometheus running)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class Tools:
    promtool: str
    prometheus: str


@dataclass(frozen=True)
class Server:
    url: str
    port: int
    log: Path


@dataclass(frozen=True)
class Prometheus:
    url: str
    config: Path
    log: Path


def which(name: str) -> str | None:
    """A tool from the venv (pip-installed binaries such as hadolint) or from PATH."""
    candidate = VENV_BIN / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which(name)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


def load_yaml_all(path: Path) -> list[Any]:
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def kvstrata_command() -> list[str]:
    script = VENV_BIN / "kvstrata"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kvstrata"]
