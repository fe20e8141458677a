"""`kvstrata serve`: not built yet (issue: OpenAI-compatible server)."""

from __future__ import annotations

import argparse
import sys

HELP = "Start the OpenAI-compatible server (not built yet)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)


def run(args: argparse.Namespace) -> int:
    print("kvstrata serve: the server is not built yet; nothing is started.", file=sys.stderr)
    return 2
