"""The one `kvstrata` command. Each subcommand lives in the package that owns it.

A subcommand module exposes ``HELP: str``, ``add_arguments(parser)`` and ``run(args) -> int``; it keeps
heavy imports (torch, transformers) inside ``run`` so that ``kvstrata --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvstrata import __version__

SUBCOMMANDS: dict[str, str] = {
    "serve": "kvstrata.server.cli",
    "eval": "kvstrata.eval.cli",
    "calibrate": "kvstrata.engine.calibrate",
    "capacity": "kvstrata.radix.capacity",
    "bench": "kvstrata.bench.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstrata",
        description="LLM serving with a stratified KV cache: BF16 recent window over quantized history.",
    )
    parser.add_argument("--version", action="version", version=f"kvstrata {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        sub_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
