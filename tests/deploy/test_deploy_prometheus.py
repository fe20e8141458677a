"""A real Prometheus (Debian's package) scraping a real `kvstrata serve`, both on loopback: after a little
traffic, every PromQL expression of the Grafana dashboard and of the alert rules evaluates through
Prometheus's HTTP API, and the main panels return data."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from deploy_helpers import DEPLOY, Prometheus, Server, load_yaml

# Grafana variables as Grafana would expand them for "All instances" on a 1 s scrape interval.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".*"}
# Panels that must show data after a few completions on the default configuration. The others need
# events a short run does not produce: absmax needs static scales (--kv-scales), non-finite K/V
# needs NaN/Inf inputs.
MAIN_PANELS = (
    "Running requests",
    "Queued requests",
    "Generation throughput",
    "Cache hit rate",
    "Perplexity drift (EWMA)",
    "Fallback level",
    "Token throughput",
    "Requests",
    "Running and queued requests",
    "Time to first token",
    "Inter-token latency",
    "End-to-end request latency",
    "KV token usage per tier",
    "KV bytes per tier and state",
    "KV pages per tier and state",
    "Bytes per token per tier",
    "Prefix cache hit rate",
    "Pinned, quantized and evicted pages",
    "Quantization overflow ratio per layer",
    "Perplexity drift",
    "KL divergence",
    "Stored bits per element per layer",
    "Pinned bytes and pins",  # zero-valued series with a text model: present, finite
    "Vision tower runs and skips",
    "Preemptions and NaN/Inf logits",
)
NO_DATA_EXPECTED = {"Absmax vs calibration per layer", "Non-finite K/V elements"}
PROMPT_PREFIX = (
    "Prometheus scrapes the metrics endpoint of every target at a fixed interval and stores each "
    "sample in its time series database, so that dashboards and alert rules can query them later. "
)
TRAFFIC_TIMEOUT_S = 120
WAIT_TIMEOUT_S = 60


def query(prom: Prometheus, expr: str) -> list[dict[str, Any]]:
    """Instant query; fails the test on any error Prometheus reports."""
    response = httpx.get(f"{prom.url}/api/v1/query", params={"query": expr}, timeout=10)
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", f"{expr}\n-> {body}"
    assert not body.get("warnings"), f"{expr}\n-> {body['warnings']}"
    assert body["data"]["resultType"] == "vector", expr
    return list(body["data"]["result"])


def wait_for(what: str, check: Callable[[], bool], timeout: float = WAIT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def expand(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr.replace("$labels", "").replace("$value", ""), f"unexpanded variable in {expr}"
    return expr


def dashboard_panels() -> list[dict[str, Any]]:
    dash = json.loads((DEPLOY / "grafana" / "kvstrata.json").read_text())
    return [p for p in dash["panels"] if p["type"] != "row"]


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"] for r in g["rules"]]


def scalar(prom: Prometheus, expr: str) -> float:
    result = query(prom, expr)
    assert len(result) == 1, f"{expr} -> {result}"
    return float(result[0]["value"][1])


@pytest.fixture(scope="module")
def traffic(kvstrata_server: Server, prometheus: Prometheus) -> Prometheus:
    """Six completions (max_tokens 8; four share a long prefix so that the radix cache hits), then wait
    until Prometheus has scraped them all and the drift monitor has re-scored them."""
    wait_for(
        "a first scrape of the server (so that rate() sees the traffic as increases)",
        lambda: bool(query(prometheus, 'up{job="kvstrata"} == 1')),
    )
    with httpx.Client(base_url=kvstrata_server.url, timeout=TRAFFIC_TIMEOUT_S) as client:
        (model,) = [m["id"] for m in client.get("/v1/models").json()["data"]]
        prompts = [
            PROMPT_PREFIX + f"Question {i}: what does a scrape interval of {i} seconds mean?"
            for i in range(4)
        ]
        prompts += ["Write one word about the sea.", "Name a prime number."]
        for prompt in prompts:
            response = client.post(
                "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            )
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] >= 1
    n = len(prompts)
    wait_for(
        f"{n} successful requests in Prometheus",
        lambda: any(
            float(r["value"][1]) >= n
            for r in query(prometheus, 'kvstrata:requests_finished_total{job="kvstrata", status="success"}')
        ),
    )
    wait_for(
        "re-scored requests (kvstrata:ppl_drift_ratio_count) in Prometheus",
        lambda: any(float(r["value"][1]) >= 1 for r in query(prometheus, "kvstrata:ppl_drift_ratio_count")),
    )
    time.sleep(3)  # a few more 1 s scrapes, so that rate() has two samples after the last change
    return prometheus


def test_targets_are_up_including_the_kubernetes_relabeling(
    traffic: Prometheus, kvstrata_server: Server
) -> None:
    targets = httpx.get(f"{traffic.url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    by_job = {t["labels"]["job"]: t for t in targets}
    assert {"kvstrata", "prometheus", "kvstrata-k8s-relabel"} <= set(by_job)
    for job, target in by_job.items():
        assert target["health"] == "up", f"{job}: {target.get('lastError')}"
    # deploy/k8s/prometheus.yml's relabeling turned the pod's annotations into the scrape URL.
    k8s = by_job["kvstrata-k8s-relabel"]
    assert k8s["scrapeUrl"] == f"http://127.0.0.1:{kvstrata_server.port}/metrics"
    assert k8s["labels"]["namespace"] == "serving" and k8s["labels"]["pod"] == "kvstrata-0"


def test_every_dashboard_expression_evaluates(traffic: Prometheus) -> None:
    exprs = [(p["title"], t["expr"]) for p in dashboard_panels() for t in p["targets"]]
    assert len(exprs) >= 30
    for title, expr in exprs:
        query(traffic, expand(expr))  # asserts status success, no warnings
        # The same over a range, as Grafana draws it.
        response = httpx.get(
            f"{traffic.url}/api/v1/query_range",
            params={"query": expand(expr), "start": time.time() - 60, "end": time.time(), "step": "5"},
            timeout=10,
        )
        assert response.json()["status"] == "success", f"{title}: {expr} -> {response.text}"


def test_dashboard_instance_variable_lists_the_server(traffic: Prometheus, kvstrata_server: Server) -> None:
    dash = json.loads((DEPLOY / "grafana" / "kvstrata.json").read_text())
    variable = next(v for v in dash["templating"]["list"] if v["name"] == "instance")
    # label_values(METRIC, LABEL) is Grafana's; it asks Prometheus for LABEL's values on METRIC's series.
    inner = variable["query"]["query"].removeprefix("label_values(").removesuffix(")")
    metric, label = (part.strip() for part in inner.split(","))
    response = httpx.get(f"{traffic.url}/api/v1/label/{label}/values", params={"match[]": metric}, timeout=10)
    assert f"127.0.0.1:{kvstrata_server.port}" in response.json()["data"]


def test_main_panels_return_data(traffic: Prometheus) -> None:
    panels = {p["title"]: p for p in dashboard_panels()}
    assert set(MAIN_PANELS) | NO_DATA_EXPECTED == set(panels), "classify every panel"
    empty = []
    for title in MAIN_PANELS:
        for target in panels[title]["targets"]:
            expr = expand(target["expr"])
            result = query(traffic, expr)
            if not result:
                empty.append(f"{title}: {expr}")
            elif "histogram_quantile" in expr or "rate(" in expr:
                values = [float(r["value"][1]) for r in result]
                if not all(math.isfinite(v) for v in values):
                    empty.append(f"{title}: {expr} = {values}")
    assert not empty, "panels without data after traffic:\n" + "\n".join(empty)


def test_latency_quantiles_are_plausible(traffic: Prometheus) -> None:
    p50 = scalar(traffic, expand(panel_expr("Time to first token", "p50")))
    p99 = scalar(traffic, expand(panel_expr("Time to first token", "p99")))
    assert 0 < p50 <= p99 < 120
    itl = scalar(traffic, expand(panel_expr("Inter-token latency", "p50")))
    assert 0 < itl < 30
    generated = scalar(traffic, 'kvstrata:generation_tokens_total{job="kvstrata"}')
    assert generated >= 6  # six requests, at least one token each
    hit = scalar(traffic, 'kvstrata:cached_tokens_total{job="kvstrata"}')
    assert hit > 0, "four prompts share a long prefix: the radix cache should have served some tokens"


def panel_expr(title: str, legend: str) -> str:
    panel = next(p for p in dashboard_panels() if p["title"] == title)
    return next(t["expr"] for t in panel["targets"] if t["legendFormat"] == legend)


def test_every_alert_expression_evaluates_and_stays_quiet(traffic: Prometheus) -> None:
    """On a healthy server after successful traffic, no alert condition holds."""
    for rule in alert_rules():
        result = query(traffic, rule["expr"])
        assert result == [], f"{rule['alert']} holds on a healthy server: {result}"


def test_prometheus_evaluates_the_loaded_rules_without_error(traffic: Prometheus) -> None:
    expected = {r["alert"] for r in alert_rules()}

    def evaluated() -> bool:
        groups = httpx.get(f"{traffic.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return {r["name"] for r in rules} == expected and all(
            not r.get("lastEvaluation", "0001").startswith("0001") for r in rules
        )

    wait_for("every alert rule evaluated once", evaluated)
    groups = httpx.get(f"{traffic.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    for rule in (r for g in groups for r in g["rules"]):
        assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"
        assert rule["state"] == "inactive", f"{rule['name']} is {rule['state']}"


def test_drift_ewma_is_a_perplexity_ratio(traffic: Prometheus) -> None:
    """The dashboard and KvstrataPerplexityDrift read kvstrata:ppl_drift_ewma as a smoothed perplexity
    ratio (quantized / reference, ~1.0 when quantization costs nothing), on the same scale as the
    kvstrata:ppl_drift_ratio histogram and as --drift-threshold (default 1.05)."""
    mean_ratio = scalar(
        traffic,
        'kvstrata:ppl_drift_ratio_sum{job="kvstrata"} / kvstrata:ppl_drift_ratio_count{job="kvstrata"}',
    )
    ewma = scalar(traffic, 'kvstrata:ppl_drift_ewma{job="kvstrata"}')
    assert 0.5 < mean_ratio < 2.0
    assert abs(ewma - mean_ratio) < 0.25, (
        f"kvstrata:ppl_drift_ewma = {ewma} but the mean re-scored perplexity ratio is {mean_ratio}: "
        "the gauge is not on the ratio scale that its help text, --drift-threshold and the alert use"
    )


def test_container_healthcheck_script_against_the_server(kvstrata_server: Server) -> None:
    """deploy/healthcheck.py is the image's HEALTHCHECK: 0 against a live server, 1 against a dead port."""
    script = str(DEPLOY / "healthcheck.py")
    env = {**os.environ, "KVSTRATA_PORT": str(kvstrata_server.port)}
    env.pop("KVSTRATA_HEALTH_URL", None)
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"127.0.0.1:{kvstrata_server.port}/health: HTTP 200" in done.stdout
    env["KVSTRATA_HEALTH_URL"] = f"{kvstrata_server.url}/no-such-endpoint"
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "HTTP 404" in done.stderr
    env["KVSTRATA_HEALTH_URL"] = "http://127.0.0.1:9/health"  # discard port: nothing listens
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
