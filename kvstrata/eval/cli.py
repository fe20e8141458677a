"""`kvstrata eval`: the accuracy lab (perplexity drift, KL, top-1, bytes per token, sensitivity, plans)."""

from __future__ import annotations

import argparse
from typing import Any

HELP = "Measure what each KV-cache configuration costs in quality (perplexity drift, KL, top-1)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded model)")
    parser.add_argument("--corpus", default=None, help="UTF-8 text file (default: the Wikipedia summaries)")
    parser.add_argument(
        "--configs",
        default="auto,bf16,fp8_e4m3,fp8_e5m2,int8,int4,fp4_e2m1",
        help="codec names, auto, or plan .json files",
    )
    parser.add_argument("--recent-window", default=None, help="sweep, e.g. 0,64,128,512 (default: shipped)")
    parser.add_argument("--rotation", default=None, help="sweep of off,hadamard (default: shipped)")
    parser.add_argument("--sinks", default=None, help="sweep of off,on (default: shipped)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024, help="tokens per window")
    parser.add_argument("--tokens", type=int, default=32768, help="corpus tokens to evaluate")
    parser.add_argument("--out", required=True, help="results JSON")
    parser.add_argument("--plot", default=None, help="PNG of drift vs bytes per token")
    parser.add_argument("--sensitivity", action="store_true", help="rank layers, one quantized at a time")
    parser.add_argument("--sensitivity-codec", default="fp4_e2m1")
    parser.add_argument("--sensitivity-window", type=int, default=0)
    parser.add_argument("--sensitivity-tokens", type=int, default=4096)
    parser.add_argument(
        "--emit-plan", default=None, help="write a per-layer codec plan JSON (implies --sensitivity)"
    )
    parser.add_argument("--plan-high", default="fp8_e4m3", help="codec of the most sensitive layers")
    parser.add_argument("--plan-budget", type=float, default=0.30, help="plan bytes/token as a share of BF16")
    parser.add_argument("--plan-window", type=int, default=None, help="plan's BF16 window (default: codec's)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the 95%% CI")
    parser.add_argument("--no-dense-check", action="store_true", help="skip the dense_forward comparison")
    parser.add_argument("--markdown", default=None, help="also write the table as Markdown here")
    parser.add_argument(
        "--kv-plan",
        default="auto",
        choices=["auto", "off"],
        help="auto: measure each bare codec with the plan the engine's load-time pass picks (as served)",
    )
    parser.add_argument(
        "--rows-per-step",
        type=int,
        default=None,
        help="tokens per forward pass (default: 1024 CPU, 16384 GPU)",
    )


def options_from_args(args: argparse.Namespace) -> Any:
    from kvstrata.eval.configs import parse_bool_list, parse_list
    from kvstrata.eval.lab import LabOptions

    windows = None
    if args.recent_window is not None:
        try:
            windows = [int(w) for w in parse_list(args.recent_window, "--recent-window")]
        except ValueError as exc:
            raise ValueError(f"--recent-window: {exc}") from exc
    for name, value in (
        ("--page-size", args.page_size),
        ("--context", args.context),
        ("--tokens", args.tokens),
    ):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    if args.tokens < args.context:
        raise ValueError(f"--tokens ({args.tokens}) must be at least --context ({args.context})")
    for w in windows or []:
        if w < 0 or w % args.page_size:
            raise ValueError(
                f"--recent-window {w} must be a non-negative multiple of --page-size {args.page_size}"
            )
    return LabOptions(
        model=args.model,
        corpus=args.corpus,
        configs=parse_list(args.configs, "--configs"),
        recent_windows=windows,
        rotations=None
        if args.rotation is None
        else parse_bool_list(args.rotation, "--rotation", ("hadamard", "on")),
        sinks=None
        if args.sinks is None
        else parse_bool_list(args.sinks, "--sinks", ("on", "true", "yes", "1")),
        page_size=args.page_size,
        context=args.context,
        tokens=args.tokens,
        sensitivity=args.sensitivity,
        sensitivity_codec=args.sensitivity_codec,
        sensitivity_window=args.sensitivity_window,
        sensitivity_tokens=args.sensitivity_tokens,
        emit_plan=args.emit_plan,
        plan_high=args.plan_high,
        plan_budget=args.plan_budget,
        plan_window=args.plan_window,
        dtype=args.dtype,
        device=args.device,
        bootstrap=args.bootstrap,
        dense_check=not args.no_dense_check,
        rows_per_step=args.rows_per_step or (1024 if args.device == "cpu" else 16384),
        kv_plan=args.kv_plan,
    )


class RichReporter:
    def __init__(self, console: Any) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = console
        self.progress = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        self.task: Any = None

    def stage(self, text: str) -> None:
        self.console.log(text)

    def start(self, description: str, total: int) -> None:
        self.progress.start()
        self.task = self.progress.add_task(description, total=total)

    def advance(self, n: int) -> None:
        self.progress.advance(self.task, n)

    def stop(self) -> None:
        self.progress.stop()


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    try:
        opts = options_from_args(args)
    except ValueError as exc:
        console.print(f"kvstrata eval: {exc}", style="red", soft_wrap=True, markup=False, highlight=False)
        return 2

    from kvstrata.eval.corpus import CorpusError
    from kvstrata.eval.lab import run_lab
    from kvstrata.eval.plot import plot_drift
    from kvstrata.eval.report import markdown_table, render_table, write_json
    from kvstrata.resources import ResourceNotInstalled

    try:
        doc, plan = run_lab(opts, RichReporter(console))
    except (CorpusError, ResourceNotInstalled, FileNotFoundError, ValueError, KeyError) as exc:
        console.print(f"kvstrata eval: {exc}", style="red", soft_wrap=True, markup=False, highlight=False)
        return 2
    write_json(doc, args.out)
    out = Console()
    if not out.is_terminal:
        out = Console(width=140)
    out.print(render_table(doc, doc["bf16_bytes_per_token"]))
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(markdown_table(doc, doc["bf16_bytes_per_token"]) + "\n")
    if plan is not None:
        ranked = ", ".join(f"{r['layer']}" for r in plan["sensitivity"][:8])
        console.log(f"most sensitive layers: {ranked}; plan at {plan['ratio_to_bf16']:.3f}x BF16")
    if args.plot:
        plot_drift(doc, args.plot)
        console.log(f"wrote {args.plot}")
    console.log(f"wrote {args.out} ({doc['wall_s']} s)")
    return 0
