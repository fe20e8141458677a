"""`kvstrata eval` end to end on a tiny model, and its clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.cli import main
from kvstrata.eval.report import RESULT_KEYS


def test_eval_cli_writes_schema_table_plot_and_plan(tiny_models, tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text(
        "The quick brown fox jumps over the lazy dog. " * 40
        + "Zwölf Boxkämpfer jagen Viktor quer über den Sylter Deich. " * 40,
        encoding="utf-8",
    )
    out, png, plan = tmp_path / "r.json", tmp_path / "d.png", tmp_path / "plan.json"
    args = ["eval", "--model", str(tiny_models[0]), "--corpus", str(corpus), "--out", str(out)]
    args += ["--configs", "auto,bf16,int8,fp4_e2m1", "--context", "64", "--tokens", "256", "--plot", str(png)]
    args += ["--emit-plan", str(plan), "--plan-budget", "0.4", "--plan-window", "16"]
    args += ["--sensitivity-tokens", "64", "--bootstrap", "200"]
    rc = main(args)
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["tokens"] == 256 and doc["windows"] == 4 and doc["scored_tokens"] == 4 * 63
    assert doc["corpus"] == str(corpus) and doc["model"] == "planted"
    names = [r["kv_cache_dtype"] for r in doc["results"]]
    assert names == ["auto", "bf16", "int8", "fp4_e2m1", str(plan)]
    for r in doc["results"]:
        assert set(RESULT_KEYS) <= set(r)
        assert r["drift_ci95"][0] <= r["drift_pct"] <= r["drift_ci95"][1]
    auto, bf16 = doc["results"][0], doc["results"][1]
    assert auto["drift_pct"] == 0.0 and auto["kl"] == 0.0 and auto["top1_agreement"] == 1.0
    assert bf16["bytes_per_token"] == doc["bf16_bytes_per_token"] == 2 * 4 * 2 * 32 * 2  # K+V, 4 layers, bf16
    assert doc["reference_check"]["nll_rel_diff"] < 1e-5
    plan_doc = json.loads(plan.read_text())
    assert len(plan_doc["layer_codecs"]) == 4
    assert plan_doc["ratio_to_bf16"] <= 0.4
    assert "fp8_e4m3" in plan_doc["layer_codecs"]  # the budget leaves room to raise the top layers
    top = plan_doc["sensitivity"][0]["layer"]
    assert plan_doc["layer_codecs"][top] == "fp8_e4m3"
    assert doc["results"][4]["layer_codecs"] == plan_doc["layer_codecs"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "fp4_e2m1 w256 sinks" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty"),
        (b"  \n\n ", "is empty"),
        (b"\xff\xfe\xfa bad", "not UTF-8"),
        (b"tiny text", "too short"),
    ],
)
def test_eval_cli_rejects_bad_corpora(
    tiny_models, tmp_path: Path, capsys, content: bytes, message: str
) -> None:
    corpus = tmp_path / "bad.txt"
    corpus.write_bytes(content)
    rc = main(
        ["eval", "--model", str(tiny_models[0]), "--corpus", str(corpus), "--out", str(tmp_path / "r.json")]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "kvstrata eval" in err
    assert not (tmp_path / "r.json").exists()


def test_eval_cli_rejects_bad_arguments(tmp_path: Path, capsys) -> None:
    out = str(tmp_path / "r.json")
    assert main(["eval", "--corpus", str(tmp_path / "missing.txt"), "--out", out]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["eval", "--recent-window", "0,10", "--out", out]) == 2
    assert "multiple of --page-size 16" in capsys.readouterr().err
    assert main(["eval", "--context", "1024", "--tokens", "100", "--out", out]) == 2
    assert "at least --context" in capsys.readouterr().err
    assert main(["eval", "--configs", "auto,fp3", "--corpus", __file__, "--out", out]) == 2
    assert "unknown config 'fp3'" in capsys.readouterr().err
