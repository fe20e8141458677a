"""`kvstrata serve` flags: every flag has a KVSTRATA_* variable; flag > variable > default."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvstrata.cli import build_parser
from kvstrata.server.config import FLAGS, ServerConfig, add_flags

ISSUE_FLAGS = [
    "--model",
    "--served-model-name",
    "--dtype",
    "--kv-cache-dtype",
    "--recent-window",
    "--page-size",
    "--max-total-tokens",
    "--mem-fraction-static",
    "--max-running-requests",
    "--kv-scales",
    "--host",
    "--port",
    "--api-key",
    "--drift-sample-rate",
    "--drift-threshold",
    "--log-level",
    "--max-request-bytes",
    "--protect-metrics",
]


def parse(argv: list[str], env: dict[str, str] | None = None) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_flags(parser, env or {})
    return ServerConfig.from_namespace(parser.parse_args(argv))


def test_every_flag_and_its_variable() -> None:
    options = {f.option for f in FLAGS}
    assert set(ISSUE_FLAGS) <= options
    assert {f.env for f in FLAGS} == {"KVSTRATA_" + o[2:].replace("-", "_").upper() for o in options}
    sub = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    assert set(ISSUE_FLAGS) <= {s for a in sub._actions for s in a.option_strings}


def test_docs_list_every_flag_with_its_variable() -> None:
    """docs/server.md's configuration table: one row per flag, ``| `--flag` | `KVSTRATA_...` |``."""
    text = (Path(__file__).parents[2] / "docs" / "server.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `(--[a-z0-9-]+)` \| `(KVSTRATA_[A-Z0-9_]+)` \|", text, re.MULTILINE))
    assert rows == {f.option: f.env for f in FLAGS}


def test_readme_table_lists_every_flag() -> None:
    """README's "Configuration" table: every flag in a row's first cell (some rows name two or three)."""
    text = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    table = text.split("## Configuration (`kvstrata serve`)", 1)[1].split("\n## ", 1)[0]
    cells = re.findall(r"^\| ([^|]+) \|", table, re.MULTILINE)
    listed = {flag for cell in cells for flag in re.findall(r"`(--[a-z0-9-]+)`", cell)}
    assert listed == {f.option for f in FLAGS}


def test_defaults() -> None:
    cfg = parse([])
    assert cfg == ServerConfig()
    assert (cfg.host, cfg.port, cfg.log_level, cfg.protect_metrics) == ("127.0.0.1", 30000, "info", False)
    assert cfg.max_request_bytes == 4 * 1024 * 1024
    assert cfg.engine_kwargs() == {}  # the engine's own defaults apply


def test_environment_and_precedence() -> None:
    env = {
        "KVSTRATA_PORT": "8123",
        "KVSTRATA_KV_CACHE_DTYPE": "int4",
        "KVSTRATA_RECENT_WINDOW": "64",
        "KVSTRATA_DRIFT_SAMPLE_RATE": "0.25",
        "KVSTRATA_API_KEY": "from-env",
        "KVSTRATA_PROTECT_METRICS": "true",
        "KVSTRATA_LOG_LEVEL": "DEBUG",
    }
    cfg = parse(["--port", "9000", "--recent-window", "32"], env)
    assert cfg.port == 9000 and cfg.recent_window == 32  # flags win
    assert cfg.kv_cache_dtype == "int4" and cfg.drift_sample_rate == 0.25 and cfg.api_key == "from-env"
    assert cfg.protect_metrics is True and cfg.log_level == "debug"
    assert cfg.engine_kwargs() == {"kv_cache_dtype": "int4", "recent_window": 32, "drift_sample_rate": 0.25}
    assert parse(["--protect-metrics"]).protect_metrics is True
    assert parse(["--protect-metrics", "false"], {"KVSTRATA_PROTECT_METRICS": "1"}).protect_metrics is False


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--port", "70000"], {}),
        (["--drift-sample-rate", "1.5"], {}),
        (["--page-size", "0"], {}),
        (["--log-level", "loud"], {}),
        ([], {"KVSTRATA_PORT": "eighty"}),
        ([], {"KVSTRATA_PROTECT_METRICS": "maybe"}),
        ([], {"KVSTRATA_MAX_REQUEST_BYTES": "-1"}),
        (["--switch-interval", "0"], {}),
        (["--switch-interval", "inf"], {}),
        (["--switch-interval", "1e-7"], {}),  # Python keeps whole microseconds: it would become 0
        (["--gc-threshold", "1,2,3,4"], {}),
        (["--gc-threshold", "-1"], {}),
        ([], {"KVSTRATA_GC_THRESHOLD": "many"}),
    ],
)
def test_bad_values_exit_with_usage_error(argv: list[str], env: dict[str, str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(argv, env)
    assert exc.value.code == 2


def test_switch_interval_is_not_an_engine_option() -> None:
    cfg = parse(["--switch-interval", "0.0005"])
    assert cfg.switch_interval == 0.0005 and cfg.engine_kwargs() == {}


def test_gc_threshold_takes_one_to_three_integers_and_is_not_an_engine_option() -> None:
    assert parse(["--gc-threshold", "50000,20,100"]).gc_threshold == (50000, 20, 100)
    assert parse([], {"KVSTRATA_GC_THRESHOLD": "50000 20"}).gc_threshold == (50000, 20)
    cfg = parse(["--gc-threshold", "0"])
    assert cfg.gc_threshold == (0,) and cfg.engine_kwargs() == {}
    assert parse([]).gc_threshold == (50000, 20, 100)  # the default; Python's own on request:
    assert parse(["--gc-threshold", "700,10,10"]).gc_threshold == (700, 10, 10)


def test_serve_sets_the_gc_thresholds_it_is_given() -> None:
    import gc
    import logging

    from kvstrata.server.cli import apply_process_settings

    before = gc.get_threshold()
    try:
        apply_process_settings(parse(["--gc-threshold", "700,10,10"]), logging.getLogger("test"))
        assert gc.get_threshold() == (700, 10, 10)
        apply_process_settings(parse([]), logging.getLogger("test"))  # the default
        assert gc.get_threshold() == (50000, 20, 100)
    finally:
        gc.set_threshold(*before)


def test_chunked_prefill_size_reaches_the_engine() -> None:
    assert parse(["--chunked-prefill-size", "8192"]).engine_kwargs() == {"chunked_prefill_size": 8192}
    env = {"KVSTRATA_CHUNKED_PREFILL_SIZE": "4096"}
    assert parse([], env).engine_kwargs() == {"chunked_prefill_size": 4096}
    with pytest.raises(SystemExit):
        parse(["--chunked-prefill-size", "0"])
