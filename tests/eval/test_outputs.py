"""Configs grid, JSON schema, Markdown/rich table and the Pareto plot, without a model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.eval.configs import SHIPPED_DEFAULTS, EvalConfig, build_grid, parse_bool_list
from kvstrata.eval.plot import pareto_front, plot_drift
from kvstrata.eval.report import (
    RESULT_KEYS,
    ConfigResult,
    build_document,
    markdown_table,
    render_table,
    validate_document,
    write_json,
)
from kvstrata.eval.stats import Summary

CODECS = ["bf16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "fp4_e2m1"]


def test_grid_uses_shipped_defaults_for_a_bare_codec_and_sweeps_when_asked() -> None:
    grid = build_grid(["bf16", "fp4_e2m1"], None, None, None, CODECS)
    assert [c.kv_cache_dtype for c in grid] == ["auto", "bf16", "fp4_e2m1"]
    fp4 = grid[2]
    d = SHIPPED_DEFAULTS["fp4_e2m1"]
    assert (fp4.recent_window, fp4.rotation, fp4.sinks) == (d.recent_window, d.rotation, d.sinks)
    sweep = build_grid(["auto", "int4"], [0, 64, 128], [False, True], None, CODECS)
    assert len(sweep) == 1 + 6  # reference + 3 windows x 2 rotations
    assert {c.recent_window for c in sweep[1:]} == {0, 64, 128}


def test_grid_rejects_unknown_codec_and_reads_plans(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown config 'fp3'"):
        build_grid(["fp3"], None, None, None, CODECS)
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps({"layer_codecs": ["fp8_e4m3", "fp4_e2m1"], "recent_window": 64, "sinks": True})
    )
    (cfg,) = build_grid([str(plan)], None, None, None, CODECS)[1:]
    assert cfg.layer_codecs == ("fp8_e4m3", "fp4_e2m1")
    assert (cfg.recent_window, cfg.sinks) == (64, True)
    assert cfg.codecs(2) == ["fp8_e4m3", "fp4_e2m1"]
    with pytest.raises(ValueError, match="has 2 layers, model has 3"):
        cfg.codecs(3)
    with pytest.raises(ValueError, match="not one of"):
        parse_bool_list("off,maybe", "--sinks", ("on",))


def _result(name: str, drift: float, bpt: float) -> ConfigResult:
    s = Summary(
        tokens=1000,
        perplexity=10 * (1 + drift / 100),
        ref_perplexity=10.0,
        drift_pct=drift,
        drift_ci95=(drift - 0.1, drift + 0.1),
        kl=drift / 1000,
        top1_agreement=0.99,
    )
    return ConfigResult(EvalConfig(name, None, 128, False, name == "fp4_e2m1"), s, bpt, 1024)


def test_document_schema_table_and_plot(tmp_path: Path) -> None:
    results = [
        _result("auto", 0.0, 23040),
        _result("bf16", 0.01, 11520),
        _result("fp8_e4m3", 0.02, 5800),
        _result("int8", 0.05, 6200),
        _result("fp4_e2m1", 0.2, 3240),
    ]
    doc = build_document("m", "c", 4096, results, context=1024)
    assert list(doc)[:4] == ["model", "corpus", "tokens", "results"]
    for r in doc["results"]:
        assert set(RESULT_KEYS) <= set(r)
    fp4 = doc["results"][4]
    assert fp4["kv_cache_dtype"] == "fp4_e2m1"
    assert fp4["rotation"] == "off" and fp4["sinks"] is True
    assert fp4["drift_ci95"] == pytest.approx([0.1, 0.3])
    path = tmp_path / "r.json"
    write_json(doc, path)
    validate_document(json.loads(path.read_text()))
    md = markdown_table(doc, 11520)
    assert "| fp4_e2m1 w128 sinks | 10.0200 | +0.200 | [+0.100, +0.300] |" in md
    assert "0.281 |" in md  # 3240 / 11520
    assert render_table(doc, 11520).row_count == 5
    png = tmp_path / "d.png"
    front = plot_drift(doc, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [doc["results"][i]["kv_cache_dtype"] for i in front] == ["fp4_e2m1", "fp8_e4m3", "bf16", "auto"]
    bad = dict(doc, results=[dict(doc["results"][0], kl=float("nan"))])
    with pytest.raises(ValueError, match="non-finite"):
        validate_document(bad)
    with pytest.raises(ValueError, match="lacks 'tokens'"):
        validate_document({"model": "m", "corpus": "c", "results": []})


def test_pareto_front_by_hand() -> None:
    pts = [(1.0, 5.0), (2.0, 1.0), (3.0, 2.0), (4.0, 0.5), (0.5, 9.0)]
    assert pareto_front(pts) == [4, 0, 1, 3]
