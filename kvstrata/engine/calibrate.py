"""`kvstrata calibrate`: run a model over text and write static K/V clip values (a scales file).

The model runs window by window through the attention callback with plain causal attention; the callback
hands each layer's keys (after RoPE and q/k-norm: what the cache stores) and values to
``kvstrata.quant.scales.ScaleStats``. Windows are consecutive ``--context``-token slices of the tokenized
corpus (no BOS added beyond what the tokenizer adds), ``--tokens`` tokens in all.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

HELP = "Measure K/V magnitudes of a model over a text corpus and write a static scales file."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded model)")
    parser.add_argument("--corpus", default=None, help="UTF-8 text file (default: the Wikipedia summaries)")
    parser.add_argument("--method", default="percentile", choices=["max", "percentile"], help="clip rule")
    parser.add_argument("--percentile", type=float, default=99.9, help="for --method percentile")
    parser.add_argument("--per-channel", action="store_true", help="one clip per head and channel")
    parser.add_argument("--tokens", type=int, default=8192, help="corpus tokens to run")
    parser.add_argument("--context", type=int, default=512, help="tokens per window")
    parser.add_argument("--batch", type=int, default=4, help="windows per forward pass")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="scales.json", help="scales file to write (JSON)")


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from kvstrata.engine.loader import load_model
    from kvstrata.quant.scales import ScaleStats
    from kvstrata.resources import load_corpus_text

    console = Console(stderr=True)
    for name in ("tokens", "context", "batch"):
        if getattr(args, name) < 1:
            console.print(f"[red]--{name} must be positive, got {getattr(args, name)}")
            return 2
    if args.method == "percentile" and not 0 < args.percentile <= 100:
        console.print(f"[red]--percentile must be in (0, 100], got {args.percentile}")
        return 2
    try:
        text = load_corpus_text(args.corpus)
        model = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]{exc}")
        return 1
    if model.tokenizer is None:
        console.print(f"[red]{model.path} has no tokenizer; calibration needs one to read the corpus")
        return 1
    ids = corpus_tokens(model.tokenizer, text, args.tokens)
    if len(ids) < args.tokens:
        console.print(f"[yellow]corpus has only {len(ids)} tokens; using all of them")
    stats = ScaleStats(per_channel=args.per_channel)
    with _progress(console) as progress:
        task = progress.add_task(f"calibrating {model.name}", total=len(ids))
        for done in observe(model.net, ids, args.context, args.batch, stats):
            progress.update(task, completed=done)
    identity = {"name": model.name, "path": str(model.path), "architecture": model.config.architecture}
    scales = stats.to_scales_file(args.method, args.percentile, model_identity=identity)
    scales.save(args.out)
    c = model.config
    console.print(
        f"wrote {args.out}: {len(ids)} tokens, {c.num_layers} layers x {c.kv_heads} kv heads x {c.head_dim}, "
        f"method={args.method}" + (f" {args.percentile}" if args.method == "percentile" else "")
    )
    return 0


def corpus_tokens(tokenizer: Any, text: str, n: int) -> list[int]:
    """The first ``n`` tokens of ``text``, tokenizing only a prefix that is long enough."""
    chars = 8 * n
    while True:
        ids = tokenizer(text[:chars])["input_ids"]
        if len(ids) > n or chars >= len(text):
            return ids[:n]
        chars *= 2


def observe(net: Any, ids: list[int], context: int, batch: int, stats: Any):
    """Run ``ids`` window by window, feeding post-RoPE K and V of every layer to ``stats``.

    Yields the number of tokens processed so far after each forward pass.
    """
    import torch

    tokens = torch.tensor(ids, dtype=torch.long, device=net.device)
    windows = list(tokens.split(context))
    for start in range(0, len(windows), batch):
        group = windows[start : start + batch]
        lens = [len(w) for w in group]
        attn = _observing(net.dense_attn_for(lens), stats)
        positions = torch.cat([torch.arange(n, device=tokens.device) for n in lens])
        with torch.inference_mode():
            net(torch.cat(group), positions, attn, logits_at=torch.tensor([0], device=tokens.device))
        yield min(len(ids), (start + len(group)) * context)


def _observing(dense: Any, stats: Any) -> Any:
    def attn(layer: int, q: Any, k: Any, v: Any) -> Any:
        stats.observe(layer, "k", k)
        stats.observe(layer, "v", v)
        return dense(layer, q, k, v)

    return attn


def load_scales_for(path: str | Path, config: Any) -> Any:
    """Read a scales file and check it fits ``config`` (a ModelConfig); ValueError names both geometries."""
    from kvstrata.quant.scales import ScalesFile

    scales = ScalesFile.load(path)
    scales.check_geometry(config.num_layers, config.kv_heads, config.head_dim)
    return scales


def _progress(console: Any) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeRemainingColumn(),
        console=console,
    )
