"""Offline checks of the container image definition and the Kubernetes manifests (k8s/).

No Docker engine and no cluster: every overlay is rendered with `kubectl kustomize`, every rendered
object is validated with `kubernetes-validate --strict` against KUBERNETES_VERSION (an object whose
kind has no schema counts as a failure, not a warning), yamllint runs on k8s/ and hadolint on the
Dockerfile, and the properties a deployment relies on are asserted on the rendered objects. The
tools come from the virtualenv that runs the tests (installed by the project's test extra).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from psycopg.conninfo import conninfo_to_dict

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
BIN = Path(sys.executable).parent  # the venv's bin dir (not resolved: that would leave the venv)

# The Kubernetes minor version the manifests are validated against; k8s/README.md states it too.
KUBERNETES_VERSION = "1.33"
OVERLAYS = ("dev", "prod", "prod-loadtest", "prod-write-pool")
# Locust (a web UI without login, pods holding admin and write keys) runs only where asked for
LOCUST_OVERLAYS = ("dev", "prod-loadtest")
NAMESPACES = {
    "dev": "shardlb-dev",
    "prod": "shardlb",
    "prod-loadtest": "shardlb",
    "prod-write-pool": "shardlb",
}
# a second router Deployment that takes the score writes (components/write-pool)
WRITE_POOL_OVERLAYS = ("prod-write-pool",)
WRITE_POOL = "shardlb-router-writes"
# Exactly what `kubectl apply -k`, Argo CD and Flux run: kustomize with its default load restrictor
# (LoadRestrictionsRootOnly), so no file may come from outside k8s/.
RENDER = ["kustomize"]

ROUTER = "shardlb-router"
ROUTER_PORT = 8000
ARCHIVER = "shardlb-archiver"
RECONCILE = "shardlb-reconcile"
BANDS = "shardlb-bands"
PRUNE = "shardlb-prune"
REDIS = "redis-cluster"
POSTGRES = "shardlb-postgres"  # the dev overlay's PostgreSQL (StatefulSet and Service)
SECRET = "shardlb-keys"
REDIS_SECRET = {"name": "redis-auth", "key": "REDIS_PASSWORD"}
POSTGRES_SECRET = "shardlb-postgres"  # key SHARDLB_POSTGRES_URL; dev generates it (name + hash)
REDIS_CLIENT_LABEL = ("shardlb.io/redis-client", "true")
POSTGRES_CLIENT_LABEL = ("shardlb.io/postgres-client", "true")
POD_OWNERS = {"Deployment", "StatefulSet", "Job", "CronJob", "DaemonSet", "ReplicaSet"}
# kinds without a namespace (the bootstrap's read of the nodes' zones, base/redis/rbac.yaml)
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
# the prod overlays expect an external PostgreSQL; only dev runs one
POSTGRES_OVERLAYS = ("dev",)


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{path} is missing: install the test extra (make install)")
    return str(path)


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)


@functools.cache
def render_text(overlay: str) -> str:
    result = run(tool("kubectl"), *RENDER, str(K8S / "overlays" / overlay))
    if result.returncode != 0:
        pytest.fail(f"kubectl kustomize k8s/overlays/{overlay} failed:\n{result.stderr}")
    return result.stdout


@functools.cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    return tuple(doc for doc in yaml.safe_load_all(render_text(overlay)) if doc)


def objects(overlay: str, kind: str) -> list[dict[str, Any]]:
    return [o for o in rendered(overlay) if o["kind"] == kind]


def get(overlay: str, kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects(overlay, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{overlay}: expected one {kind}/{name}, found {len(found)}"
    return found[0]


def generated(overlay: str, kind: str, base_name: str) -> dict[str, Any]:
    """An object from a kustomize generator, whose name carries a content hash."""
    found = [
        o
        for o in objects(overlay, kind)
        if re.fullmatch(rf"{base_name}-[a-z0-9]{{10}}", o["metadata"]["name"])
    ]
    assert len(found) == 1, f"{overlay}: expected one generated {kind} {base_name}-<hash>"
    return found[0]


def pod_template(obj: dict[str, Any]) -> dict[str, Any]:
    """The pod template of a Deployment, StatefulSet or Job, or of a CronJob's Jobs."""
    spec = obj["spec"]["jobTemplate"]["spec"] if obj["kind"] == "CronJob" else obj["spec"]
    template: dict[str, Any] = spec["template"]
    return template


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = pod_template(obj)["spec"]
    return spec


def pod_owners(overlay: str) -> list[dict[str, Any]]:
    return [o for o in rendered(overlay) if o["kind"] in POD_OWNERS]


def pod_labels(obj: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = pod_template(obj)["metadata"]["labels"]
    return labels


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod_spec(obj)["containers"] if c["name"] == name)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Does a label selector (matchLabels / matchExpressions) select these labels? An empty one
    selects everything, as in a NetworkPolicy (`podSelector: {}`: every pod of the namespace)."""
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok &= {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
    return ok


def container_port(c: dict[str, Any], port: int | str) -> int:
    """Resolve a probe's or Service's (named) port against a container's ports."""
    if isinstance(port, int):
        assert any(p["containerPort"] == port for p in c.get("ports", [])), f"{port} is not a container port"
        return port
    return next(p["containerPort"] for p in c["ports"] if p.get("name") == port)


def config_data(overlay: str, c: dict[str, Any]) -> dict[str, str]:
    """Every variable a container gets from ConfigMaps (envFrom) and literal env values."""
    maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects(overlay, "ConfigMap")}
    data: dict[str, str] = {}
    for source in c.get("envFrom", []):
        if "configMapRef" in source:
            name = source["configMapRef"]["name"]
            assert name in maps, f"{c['name']} reads ConfigMap {name}, which the overlay does not define"
            data.update(maps[name])
    data.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    return data


def secret_env(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The container's variables that come from a Secret key: name -> secretKeyRef."""
    return {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def expand(c: dict[str, Any], value: str, known: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of an env value: only variables defined earlier in `env` count."""
    defined = []
    for e in c.get("env", []):
        if e.get("value") == value:
            break
        defined.append(e["name"])
    return re.sub(r"\$\((\w+)\)", lambda m: known[m.group(1)] if m.group(1) in defined else m.group(0), value)


def policies(overlay: str, labels: dict[str, str], direction: str) -> list[dict[str, Any]]:
    """NetworkPolicies that select pods with these labels and isolate them in direction."""
    return selecting(objects(overlay, "NetworkPolicy"), labels, direction)


def selecting(found: list[dict[str, Any]], labels: dict[str, str], direction: str) -> list[dict[str, Any]]:
    """Of these NetworkPolicies, those that select pods with these labels and isolate them in direction."""
    return [
        p
        for p in found
        if selects(p["spec"]["podSelector"], labels) and direction in p["spec"].get("policyTypes", [])
    ]


def _rule_allows(rule: dict[str, Any], peers_key: str, labels: dict[str, str] | None, port: int) -> bool:
    ports = rule.get("ports")
    if ports is not None and not any(p.get("port") in (port, None) for p in ports):
        return False
    peers = rule.get(peers_key)
    if not peers:  # no peer list: every source / destination
        return True
    # labels None: a peer outside every pod of the namespace (another namespace, an outside address)
    return any(
        "ipBlock" in peer or "namespaceSelector" in peer
        if labels is None
        else "podSelector" in peer
        and "namespaceSelector" not in peer
        and selects(peer["podSelector"], labels)
        for peer in peers
    )


def admits(overlay: str, source: dict[str, str] | None, target: dict[str, str], port: int) -> bool:
    """May a pod with labels `source` (None: anything outside the namespace) connect to `target` on port?
    Both ends' policies must allow it: the target's ingress and the source's egress."""
    return admitted(objects(overlay, "NetworkPolicy"), source, target, port)


def admitted(
    found: list[dict[str, Any]], source: dict[str, str] | None, target: dict[str, str], port: int
) -> bool:
    """``admits`` under these NetworkPolicies (of a render other than an overlay's own)."""
    ingress = selecting(found, target, "Ingress")
    allowed = not ingress or any(
        _rule_allows(rule, "from", source, port) for p in ingress for rule in p["spec"].get("ingress", [])
    )
    if source is not None:
        egress = selecting(found, source, "Egress")
        allowed &= not egress or any(
            _rule_allows(rule, "to", target, port) for p in egress for rule in p["spec"].get("egress", [])
        )
    return allowed


def egress_outside(overlay: str, source: dict[str, str], port: int) -> bool:
    """May a pod with these labels connect to an address outside the namespace on port (e.g. DNS)?"""
    egress = policies(overlay, source, "Egress")
    return not egress or any(
        _rule_allows(rule, "to", None, port) for p in egress for rule in p["spec"].get("egress", [])
    )


def kubernetes_validate(path: Path) -> tuple[int, list[str]]:
    """Validate every document of a file; returns (documents passed, problems)."""
    result = run(tool("kubernetes-validate"), "--strict", "-k", f"{KUBERNETES_VERSION}.0", str(path))
    lines = (result.stdout + result.stderr).splitlines()
    passed = sum(1 for line in lines if line.startswith("INFO") and " passed " in line)
    # WARN is what kubernetes-validate says for a kind it has no schema for: a failure here
    problems = [line for line in lines if not line.startswith("INFO")]
    if result.returncode != 0 and not problems:
        problems.append(f"exit status {result.returncode}")
    return passed, problems


# ---------------------------------------------------------------- render, validate, lint


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_everything(overlay: str) -> None:
    kinds = sorted(o["kind"] for o in rendered(overlay))
    for kind in (
        "Namespace",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "StatefulSet",
        "Job",
        "ConfigMap",
        "NetworkPolicy",
        "CronJob",
    ):
        assert kind in kinds, f"{overlay} renders no {kind}"
    locust = {"locust-master", "locust-worker"} if overlay in LOCUST_OVERLAYS else set()
    pool = {WRITE_POOL} if overlay in WRITE_POOL_OVERLAYS else set()
    assert {o["metadata"]["name"] for o in objects(overlay, "Deployment")} == {
        ROUTER,
        ARCHIVER,
        *locust,
        *pool,
    }
    postgres = {POSTGRES} if overlay in POSTGRES_OVERLAYS else set()
    assert {o["metadata"]["name"] for o in objects(overlay, "StatefulSet")} == {REDIS, *postgres}
    namespace = NAMESPACES[overlay]
    assert [o["metadata"]["name"] for o in objects(overlay, "Namespace")] == [namespace]
    for o in rendered(overlay):
        if o["kind"] not in CLUSTER_SCOPED:
            assert o["metadata"].get("namespace") == namespace, f"{o['kind']}/{o['metadata']['name']}"
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "shardlb"


def test_overlays_render_with_the_default_load_restrictor() -> None:
    # `kubectl apply -k` has no flag to loosen it: an overlay that needs one does not apply at all
    for overlay in OVERLAYS:
        result = run(
            tool("kubectl"),
            "kustomize",
            "--load-restrictor",
            "LoadRestrictionsRootOnly",
            str(K8S / "overlays" / overlay),
        )
        assert result.returncode == 0, f"{overlay}: {result.stderr}"
        assert result.stdout == render_text(overlay)


def test_prod_has_no_locust() -> None:
    # Locust's web UI has no login and its pods hold admin and write keys: never in plain prod
    for o in rendered("prod"):
        text = yaml.safe_dump(o).lower()
        assert "locust" not in text, f"{o['kind']}/{o['metadata']['name']}"
    assert "locust" in render_text("prod-loadtest") and "locust" in render_text("dev")
    # the pre-launch load test runs against exactly the prod shape, plus Locust
    loadtest = rendered("prod-loadtest")
    assert all(o in loadtest for o in rendered("prod"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strictly(overlay: str, tmp_path: Path) -> None:
    out = tmp_path / f"{overlay}.yaml"
    out.write_text(render_text(overlay))
    passed, problems = kubernetes_validate(out)
    assert not problems, "\n".join(problems)
    assert passed == len(rendered(overlay))


def secret_examples() -> dict[str, dict[str, Any]]:
    """The Secrets' shapes (secret.example.yaml files) by Secret name."""
    docs = [yaml.safe_load(p.read_text()) for p in sorted(K8S.rglob("secret.example.yaml"))]
    return {d["metadata"]["name"]: d for d in docs}


def test_secret_examples_validate_and_are_in_no_kustomization() -> None:
    assert set(secret_examples()) == {SECRET, REDIS_SECRET["name"], POSTGRES_SECRET}
    for example in K8S.rglob("secret.example.yaml"):
        passed, problems = kubernetes_validate(example)
        assert not problems and passed == 1, problems
    for kustomization in K8S.rglob("kustomization.yaml"):
        doc = yaml.safe_load(kustomization.read_text())
        listed = [*doc.get("resources", []), *doc.get("components", [])]
        listed += [p.get("path", "") for p in doc.get("patches", [])]
        assert not any("secret" in str(item).lower() for item in listed), kustomization


def test_validator_catches_unknown_fields_and_kinds(tmp_path: Path) -> None:
    # The checker itself must fail on the mistakes it is here to catch.
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {ports: [{port: 80}], selectr: {}}\n"
        "---\napiVersion: example.com/v1\nkind: Widget\nmetadata: {name: b}\n"
    )
    passed, problems = kubernetes_validate(bad)
    assert passed == 0
    assert any("selectr" in p for p in problems)
    assert any("Widget" in p for p in problems)


def test_yamllint() -> None:
    result = run(tool("yamllint"), "--strict", "-c", str(K8S / ".yamllint"), str(K8S))
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint() -> None:
    result = run(tool("hadolint"), "--no-color", str(ROOT / "Dockerfile"))
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- the image


def dockerfile_stages() -> list[list[str]]:
    """Instructions (continuations joined, comments dropped) grouped by stage."""
    text = (ROOT / "Dockerfile").read_text()
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    stages: list[list[str]] = []
    for line in lines:
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_dockerfile_shape() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = dockerfile_stages()
    assert len(stages) >= 2, "multi-stage build"
    # a slim Python 3.11 base, pinned to a patch version
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert base and re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", base.group(1)), base
    builder, final = stages[0], stages[-1]
    assert any(re.search(r"pip install .*['\"]?\.\[bench\]", i) for i in builder)
    assert any(i.startswith("COPY --from=") and "/opt/venv" in i for i in final)
    # nothing is built or installed in the final stage
    joined = "\n".join(final)
    assert not re.search(r"\b(apt-get|apk|pip|gcc|make|build-essential)\b", joined), joined
    users = [i.split()[1] for i in final if i.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    entry = [i for i in final if i.startswith("ENTRYPOINT ")]
    assert entry == ['ENTRYPOINT ["shardlb", "serve"]'], entry
    health = [i for i in final if i.startswith("HEALTHCHECK ")]
    assert len(health) == 1 and "urllib" in health[0] and "/healthz" in health[0]
    assert "curl" not in health[0] and "wget" not in health[0]
    assert "CMD [" in health[0], "exec form"


def test_the_image_brings_its_own_libpq() -> None:
    # The final stage installs nothing (test_dockerfile_shape) and the slim base has no libpq, so
    # the archiver's PostgreSQL driver must ship its own: psycopg's binary wheel.
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.fullmatch(r"psycopg\[[^]]*\bbinary\b[^]]*\]\S*", d.replace(" ", "")) for d in deps), deps


def test_dockerignore_keeps_the_context_to_the_package() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "allow-list: exclude everything, then re-include"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for stage in dockerfile_stages():
        for instruction in stage:
            if instruction.startswith("COPY ") and "--from=" not in instruction:
                for source in shlex.split(instruction)[1:-1]:
                    assert source.rstrip("/") in allowed, f"{source} is copied but ignored"
    assert not allowed & {".venv", ".git", ".shardlb", "tests", "k8s"}


# ---------------------------------------------------------------- the router


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_probes_hit_the_health_routes(overlay: str) -> None:
    deployment = get(overlay, "Deployment", ROUTER)
    c = container(deployment, "router")
    assert container_port(c, "http") == ROUTER_PORT
    expected = {"readinessProbe": "/readyz", "startupProbe": "/healthz"}
    for probe, path in expected.items():
        http = c[probe]["httpGet"]
        assert http["path"] == path, probe
        assert container_port(c, http["port"]) == ROUTER_PORT, probe
    # liveness on the router's probe port (router/liveness.py), tested apart below
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    service = get(overlay, "Service", ROUTER)
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(deployment))
    (port,) = service["spec"]["ports"]
    assert port["port"] == ROUTER_PORT and container_port(c, port["targetPort"]) == ROUTER_PORT
    assert config_data(overlay, c)["SHARDLB_PORT"] == str(ROUTER_PORT)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_liveness_survives_its_connection_caps(overlay: str) -> None:
    """The liveness probe asked the API port, where a router at SHARDLB_MAX_CONNECTIONS (or with the
    node's address at SHARDLB_MAX_CLIENT_CONNECTIONS) closes the kubelet's connection at once like any
    other: Kubernetes then restarted routers that were busy, not dead. It asks the router's probe
    port instead (SHARDLB_PROBE_PORT, router/liveness.py), which the caps do not cover, bound to the
    pod's IP, in no Service and admitted by no NetworkPolicy rule (the kubelet's probes always are)."""
    for name in (ROUTER, *([WRITE_POOL] if overlay in WRITE_POOL_OVERLAYS else [])):
        deployment = get(overlay, "Deployment", name)
        c = container(deployment, "router")
        settings = config_data(overlay, c)
        probe_port = int(settings["SHARDLB_PROBE_PORT"])
        assert probe_port != ROUTER_PORT
        http = c["livenessProbe"]["httpGet"]
        assert http["path"] == "/healthz" and container_port(c, http["port"]) == probe_port, name
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert expand(c, settings["SHARDLB_PROBE_HOST"], {"POD_IP": "10.1.2.3"}) == "10.1.2.3"
        labels = pod_labels(deployment)
        for service in objects(overlay, "Service"):
            if selects({"matchLabels": service["spec"].get("selector", {})}, labels):
                targets = {container_port(c, p["targetPort"]) for p in service["spec"]["ports"]}
                assert probe_port not in targets, service["metadata"]["name"]
        for source in (None, {"app": "any-pod"}, labels):
            assert not admits(overlay, source, labels, probe_port), (name, source)
        from router.settings import Settings

        keys = {"SHARDLB_WRITE_KEYS": "w" * 32}
        parsed = Settings.from_env({**settings, **keys, "SHARDLB_PROBE_HOST": "10.1.2.3"})
        assert (parsed.probe_port, parsed.probe_host) == (probe_port, "10.1.2.3")


def test_router_health_routes_exist_in_the_router() -> None:
    # the live app's GET routes, not strings that the OpenAPI document repeats
    from starlette.routing import Route

    from router.app import create_app
    from router.settings import Settings

    app = create_app(Settings(insecure_dev=True))
    served = {r.path for r in app.routes if isinstance(r, Route) and "GET" in (r.methods or ())}
    assert {"/healthz", "/readyz"} <= served


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_settings_and_keys(overlay: str) -> None:
    deployment = get(overlay, "Deployment", ROUTER)
    c = container(deployment, "router")
    settings = config_data(overlay, c)
    for name in ("SHARDLB_REDIS_URL", "SHARDLB_HOST", "SHARDLB_PORT", "SHARDLB_DRAIN_SECONDS"):
        assert name in settings, name
    # the seed nodes are pods of the StatefulSet, by their stable names
    sts = get(overlay, "StatefulSet", REDIS)
    pods = {f"{REDIS}-{i}.{sts['spec']['serviceName']}:6379" for i in range(sts["spec"]["replicas"])}
    url = settings["SHARDLB_REDIS_URL"]
    assert url.startswith("redis://")
    seeds = url.removeprefix("redis://").partition("@")[2].split(",")
    assert len(seeds) >= 3 and set(seeds) <= pods, seeds
    # keys come from the Secret, which is referenced, required and never rendered
    refs = [s["secretRef"] for s in c["envFrom"] if "secretRef" in s]
    assert refs == [{"name": SECRET}]
    assert not any(k.endswith("_KEYS") for k in settings), "keys must not come from a ConfigMap"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_is_rendered(overlay: str) -> None:
    # the one exception: dev's generated PostgreSQL Secret, which holds nothing but that server's
    # password and URL (test_dev_runs_its_own_postgres)
    secrets = objects(overlay, "Secret")
    if overlay in POSTGRES_OVERLAYS:
        (secret,) = secrets
        assert secret["metadata"]["name"] == postgres_secret_name(overlay)
        assert set(secret["data"]) == {"POSTGRES_PASSWORD", "SHARDLB_POSTGRES_URL"}
    else:
        assert secrets == []
    text = render_text(overlay)
    for example in secret_examples().values():
        for value in example["stringData"].values():
            for key in filter(None, value.split(",")):
                assert key not in text


SHUTDOWN_MARGIN_S = 5


def shutdown_budget(overlay: str) -> tuple[int, int, int, float]:
    """(preStop sleep, server drain, coalescer drain, grace period) of the router's pods, in seconds.

    After the preStop sleep, SIGTERM: uvicorn waits up to ceil(SHARDLB_DRAIN_SECONDS) for requests
    under way (router/server.py, timeout_graceful_shutdown), then the lifespan's Service.stop gives
    the write coalescer SHARDLB_DRAIN_SECONDS more (router/service.py): two drains, one after the
    other."""
    from router.settings import Settings

    deployment = get(overlay, "Deployment", ROUTER)
    c = container(deployment, "router")
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    raw = config_data(overlay, c).get("SHARDLB_DRAIN_SECONDS")
    drain = Settings.from_env(
        {"SHARDLB_INSECURE_DEV": "true", **({"SHARDLB_DRAIN_SECONDS": raw} if raw else {})}
    )
    grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
    return int(command[1]), math.ceil(drain.drain_seconds), math.ceil(drain.drain_seconds), grace


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_shuts_down_gracefully(overlay: str) -> None:
    pre_stop, server, coalescer, grace = shutdown_budget(overlay)
    assert pre_stop >= 5
    assert grace >= pre_stop + server + coalescer + SHUTDOWN_MARGIN_S


def test_router_shutdown_comment_adds_up() -> None:
    # the comment above terminationGracePeriodSeconds says how it is made up; it must be the truth
    text = (K8S / "base" / "router" / "deployment.yaml").read_text()
    sums = re.findall(r"(\d+(?: \+ \d+)+) = (\d+) s", text)
    assert len(sums) == 1, sums
    terms, total = [int(t) for t in sums[0][0].split(" + ")], int(sums[0][1])
    pre_stop, server, coalescer, grace = shutdown_budget("dev")
    assert sum(terms) == total == grace
    assert terms[:3] == [pre_stop, server, coalescer] and terms[3] >= SHUTDOWN_MARGIN_S


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_startup_waits_for_the_cluster(overlay: str) -> None:
    c = container(get(overlay, "Deployment", ROUTER), "router")
    startup = c["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget > float(config_data(overlay, c)["SHARDLB_STARTUP_TIMEOUT_S"])


# What one router worker may hold at most, by router/README.md's bounds ("Hostile requests", "Reads
# and caches"): every connection its share of uvicorn's read buffer and a read body read ahead,
# the top cache's rows and the rank estimates' samples at their documented sizes, the two kept
# renderings (hot.py: tops by view and by query string), one write body being decoded (1 MiB of
# MessagePack peaks at 72 MiB) and the process itself (60 MiB after its imports; 100 allowed).
ROUTER_BASE_BYTES = 100 * 2**20
TOP_ROW_BYTES = 390
HISTOGRAM_SAMPLE_BYTES = 180
DECODE_FACTOR = 72


def router_memory_bound(settings: dict[str, str]) -> tuple[int, int]:
    """(workers, bytes one worker may hold at most) of a router started with these variables."""
    from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT

    from router import hot
    from router.settings import Settings

    s = Settings.from_env({"SHARDLB_INSECURE_DEV": "true", **settings})
    worker = (
        ROUTER_BASE_BYTES
        + s.max_connections * (HIGH_WATER_LIMIT + s.max_read_body_bytes)
        + s.top_cache_rows * TOP_ROW_BYTES
        + s.histogram_cache_samples * HISTOGRAM_SAMPLE_BYTES
        + 2 * hot.KEPT_BYTES
        + DECODE_FACTOR * s.max_body_bytes
    )
    return s.workers, worker


def quantity_bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)?", quantity).groups()  # type: ignore[union-attr]
    return int(number) * {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[unit]


def assert_router_memory_fits(docs: list[dict[str, Any]] | tuple[dict[str, Any], ...], where: str) -> int:
    maps = {o["metadata"]["name"]: o.get("data", {}) for o in docs if o["kind"] == "ConfigMap"}
    routers = [o for o in docs if o["kind"] == "Deployment" and o["metadata"]["name"] in (ROUTER, WRITE_POOL)]
    for deployment in routers:
        c = container(deployment, "router")
        settings = {
            k: v
            for e in c["envFrom"]
            if "configMapRef" in e
            for k, v in maps[e["configMapRef"]["name"]].items()
        }
        settings.pop("SHARDLB_REDIS_URL", None)
        workers, worker = router_memory_bound(settings)
        limit = quantity_bytes(c["resources"]["limits"]["memory"])
        name = deployment["metadata"]["name"]
        assert workers * worker <= limit, (
            f"{where}: {name}'s memory limit ({limit / 2**20:.0f} MiB) is below what its {workers} "
            f"worker(s) may hold by the router's own bounds ({workers * worker / 2**20:.0f} MiB): a "
            "flood of connections or full caches would get it OOM-killed; lower SHARDLB_MAX_CONNECTIONS "
            "or the cache bounds, or raise the limit"
        )
    return len(routers)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_memory_limit_holds_its_bounds(overlay: str) -> None:
    assert assert_router_memory_fits(rendered(overlay), overlay) >= 1


def test_router_memory_limit_of_the_base_holds_its_bounds(tmp_path: Path) -> None:
    # base/ is what an operator's own overlay starts from, before any resources patch
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\n"
        "kind: Kustomization\n"
        f"resources: [{os.path.relpath(K8S / 'base', tmp_path)}]\n"
    )
    result = run(tool("kubectl"), *RENDER, str(tmp_path))
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert assert_router_memory_fits(docs, "base") == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_accepts_its_settings(overlay: str) -> None:
    from dataclasses import fields

    from router.settings import Settings  # a router that cannot be imported fails this test

    known = {"SHARDLB_" + f.name.upper() for f in fields(Settings)}
    settings = config_data(overlay, container(get(overlay, "Deployment", ROUTER), "router"))
    unknown = {name for name in settings if name.startswith("SHARDLB_")} - known
    assert not unknown, f"settings the router does not read: {unknown}"
    # with keys shaped like the README's (openssl rand -hex 32), the router starts with them
    keys = {"SHARDLB_ADMIN_KEYS": "a" * 64, "SHARDLB_WRITE_KEYS": "b" * 64, "SHARDLB_READ_KEYS": "c" * 64}
    c = container(get(overlay, "Deployment", ROUTER), "router")
    url = expand(c, settings["SHARDLB_REDIS_URL"], {"REDIS_PASSWORD": "d" * 64})
    parsed = Settings.from_env({**settings, **keys, "SHARDLB_REDIS_URL": url})
    assert parsed.port == ROUTER_PORT and parsed.host == "0.0.0.0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpa_pdb_and_spread_target_the_router(overlay: str) -> None:
    deployment = get(overlay, "Deployment", ROUTER)
    labels = pod_labels(deployment)
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    hpa = get(overlay, "HorizontalPodAutoscaler", ROUTER)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": ROUTER}
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    pdbs = [p for p in objects(overlay, "PodDisruptionBudget") if selects(p["spec"]["selector"], labels)]
    assert [p["metadata"]["name"] for p in pdbs] == [ROUTER]
    # the router's PDB selects the router's pods and nothing else
    for other in pod_owners(overlay):
        if other is not deployment:
            assert not selects(pdbs[0]["spec"]["selector"], pod_labels(other))
    spread = pod_spec(deployment)["topologySpreadConstraints"]
    assert {s["topologyKey"] for s in spread} >= {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    assert all(selects(s["labelSelector"], labels) for s in spread)


@pytest.mark.parametrize("overlay", WRITE_POOL_OVERLAYS)
def test_the_write_pool_is_the_router_again_with_its_own_pods(overlay: str) -> None:
    """components/write-pool: the same pods as the router's (so every check of the router's holds for
    them), under their own labels, with their own Service, HPA, PDB and NetworkPolicy, and neither
    set of objects reaching the other's pods."""
    main, pool = get(overlay, "Deployment", ROUTER), get(overlay, "Deployment", WRITE_POOL)
    main_labels, pool_labels = pod_labels(main), pod_labels(pool)
    assert pool_labels == {**main_labels, "app.kubernetes.io/component": "router-writes"}
    assert pool_labels[REDIS_CLIENT_LABEL[0]] == REDIS_CLIENT_LABEL[1]
    # the pod spec is the router's but for its labels, and it reads the router's own ConfigMap
    main_c, pool_c = container(main, "router"), container(pool, "router")
    assert pool_c["envFrom"] == main_c["envFrom"]
    assert config_data(overlay, pool_c) == config_data(overlay, main_c)

    def normalised(deployment: dict[str, Any]) -> dict[str, Any]:
        spec = yaml.safe_load(yaml.safe_dump(pod_spec(deployment)))
        for constraint in spec["topologySpreadConstraints"]:
            constraint["labelSelector"]["matchLabels"].pop("app.kubernetes.io/component")
        return dict(spec)

    assert normalised(pool) == normalised(main)
    assert "replicas" not in pool["spec"], "the HPA owns the replica count"
    assert selects(pool["spec"]["selector"], pool_labels) and not selects(
        pool["spec"]["selector"], main_labels
    )
    assert all(selects(s["labelSelector"], pool_labels) for s in pod_spec(pool)["topologySpreadConstraints"])
    # each Service, HPA and PDB keeps to its own Deployment's pods
    for name, labels, others in ((ROUTER, main_labels, pool_labels), (WRITE_POOL, pool_labels, main_labels)):
        service = get(overlay, "Service", name)
        assert selects({"matchLabels": service["spec"]["selector"]}, labels)
        assert not selects({"matchLabels": service["spec"]["selector"]}, others)
        (port,) = service["spec"]["ports"]
        assert port["port"] == ROUTER_PORT
        pdb = get(overlay, "PodDisruptionBudget", name)
        assert selects(pdb["spec"]["selector"], labels) and not selects(pdb["spec"]["selector"], others)
        hpa = get(overlay, "HorizontalPodAutoscaler", name)
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    # the pool is fenced as the router is: reachable on its port, reaching Redis and DNS only
    redis_labels = pod_labels(get(overlay, "StatefulSet", REDIS))
    assert policies(overlay, pool_labels, "Ingress") and policies(overlay, pool_labels, "Egress")
    assert admits(overlay, None, pool_labels, ROUTER_PORT)
    assert admits(overlay, pool_labels, redis_labels, 6379)
    assert egress_outside(overlay, pool_labels, 53)
    assert not admits(overlay, pool_labels, main_labels, ROUTER_PORT)


@pytest.mark.parametrize("overlay", WRITE_POOL_OVERLAYS)
def test_a_router_setting_merged_over_the_write_pool_reaches_both_pools(overlay: str, tmp_path: Path) -> None:
    """k8s/README.md tells operators to set router settings (SHARDLB_JOURNAL_MAX_ENTRIES) in the
    router's ConfigMap from their own overlay. Over an overlay with the write pool, that merge must
    build, and reach the pool's routers as well as the main ones: both apply the same score writes."""
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\n"
        "kind: Kustomization\n"
        f"resources: [{os.path.relpath(K8S / 'overlays' / overlay, tmp_path)}]\n"
        "configMapGenerator:\n"
        "  - name: shardlb-router-config\n"
        "    behavior: merge\n"
        "    literals: [SHARDLB_JOURNAL_MAX_ENTRIES=1000000]\n"
    )
    result = run(tool("kubectl"), *RENDER, str(tmp_path))
    assert result.returncode == 0, f"an operator's merge over {overlay} does not build:\n{result.stderr}"
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    maps = {o["metadata"]["name"]: o.get("data", {}) for o in docs if o["kind"] == "ConfigMap"}
    for name in (ROUTER, WRITE_POOL):
        (deployment,) = [o for o in docs if o["kind"] == "Deployment" and o["metadata"]["name"] == name]
        env_from = container(deployment, "router")["envFrom"]
        refs = [e["configMapRef"]["name"] for e in env_from if "configMapRef" in e]
        assert refs and all(ref in maps for ref in refs), f"{name} reads a ConfigMap the build lacks: {refs}"
        merged = {k: v for ref in refs for k, v in maps[ref].items()}
        assert merged.get("SHARDLB_JOURNAL_MAX_ENTRIES") == "1000000", f"{name} misses the merged setting"


# ---------------------------------------------------------------- every pod


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_pinned(overlay: str) -> None:
    for owner in pod_owners(overlay):
        for c in containers(pod_spec(owner)):
            image = c["image"]
            where = f"{owner['kind']}/{owner['metadata']['name']}/{c['name']}: {image}"
            if "@sha256:" in image:
                continue
            name, _, tag = image.rpartition(":")
            assert name and "/" not in tag, f"no tag: {where}"
            assert tag != "latest", where
            assert re.fullmatch(r"v?\d+\.\d+(\.\d+)?([-.+][\w.]+)?", tag), f"not a version: {where}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_requests_and_limits(overlay: str) -> None:
    for owner in pod_owners(overlay):
        for c in containers(pod_spec(owner)):
            resources = c.get("resources", {})
            for kind in ("requests", "limits"):
                for res in ("cpu", "memory"):
                    assert res in resources.get(kind, {}), (
                        f"{owner['metadata']['name']}/{c['name']}: {kind}.{res}"
                    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_as_non_root(overlay: str) -> None:
    for owner in pod_owners(overlay):
        spec = pod_spec(owner)
        assert spec["securityContext"]["runAsNonRoot"] is True, owner["metadata"]["name"]
        assert spec["enableServiceLinks"] is False, owner["metadata"]["name"]
        for c in containers(spec):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True


# ---------------------------------------------------------------- Redis Cluster


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_statefulset(overlay: str) -> None:
    sts = get(overlay, "StatefulSet", REDIS)
    spec = sts["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["podManagementPolicy"] == "Parallel"
    c = container(sts, "redis")
    assert re.fullmatch(r"redis:7\.\d+\.\d+", c["image"]), "the official image, pinned"
    assert c["command"] == ["bash", "/scripts/redis-node.sh"]
    # persistent volumes, mounted where the node keeps AOF and nodes.conf
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"]
    settings = config_data(overlay, c)
    data_mount = next(m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert data_mount["mountPath"] == settings["REDIS_DATA_DIR"]
    assert "--appendonly yes" in (K8S / "base" / "redis" / "redis-node.sh").read_text()
    # a full shard refuses writes (503) rather than evict scores or journal entries
    assert settings["REDIS_MAXMEMORY_POLICY"] == "noeviction"
    # the stable name each node announces is its pod's name under the headless Service
    env = {e["name"]: e for e in c["env"]}
    headless = get(overlay, "Service", spec["serviceName"])
    assert env["REDIS_ANNOUNCE_HOSTNAME"]["value"] == f"$(POD_NAME).{headless['metadata']['name']}"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["REDIS_ANNOUNCE_IP"]["value"] == "$(POD_IP)"
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert selects({"matchLabels": headless["spec"]["selector"]}, labels)
    assert {p["port"] for p in headless["spec"]["ports"]} == {6379, 16379}
    assert {container_port(c, "redis"), container_port(c, "cluster-bus")} == {6379, 16379}
    # masters and replicas on different machines
    anti = pod_spec(sts)["affinity"]["podAntiAffinity"]
    terms = [t.get("podAffinityTerm", t) for rule in anti.values() for t in rule]
    assert any(
        t["topologyKey"] == "kubernetes.io/hostname" and selects(t["labelSelector"], labels) for t in terms
    )
    # probes run the probe script
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"][:2] == ["bash", "/scripts/redis-probe.sh"]
    pdb = get(overlay, "PodDisruptionBudget", REDIS)
    assert selects(pdb["spec"]["selector"], labels) and pdb["spec"]["maxUnavailable"] == 1


ZONE = "topology.kubernetes.io/zone"
HOST = "kubernetes.io/hostname"
# the prod overlays require one Redis node per machine; dev prefers it
REQUIRED_HOST_OVERLAYS = ("prod", "prod-loadtest", "prod-write-pool")


def zone_spread(obj: dict[str, Any]) -> dict[str, Any]:
    """The pod template's spread over zones: it must still schedule where there is one zone, or
    nodes without the label (kind, minikube), so ScheduleAnyway (DoNotSchedule would leave every
    pod pending on a node without the label)."""
    found = [s for s in pod_spec(obj).get("topologySpreadConstraints", []) if s["topologyKey"] == ZONE]
    assert len(found) == 1, f"{obj['metadata']['name']}: no spread over {ZONE}"
    (spread,) = found
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway" and spread["maxSkew"] == 1
    assert selects(spread["labelSelector"], pod_labels(obj))
    return spread


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_nodes_and_routers_spread_over_zones(overlay: str) -> None:
    """Prod kept one Redis node per machine, and nothing per zone: the scheduler could put a master
    and its replica in one zone, and that zone's outage took both (the shard's slots uncovered, the
    cluster down). Redis nodes and both router pools spread over the zones, and keep their
    per-machine rule (required for Redis in prod). Which node of a zone is whose replica is the
    bootstrap's plan (test_the_bootstrap_pairs_masters_and_replicas_by_zone)."""
    sts = get(overlay, "StatefulSet", REDIS)
    zone_spread(sts)
    labels = pod_labels(sts)
    anti = pod_spec(sts)["affinity"]["podAntiAffinity"]
    rules = (
        anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])
        if overlay in REQUIRED_HOST_OVERLAYS
        else [t["podAffinityTerm"] for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])]
    )
    assert any(t["topologyKey"] == HOST and selects(t["labelSelector"], labels) for t in rules)
    for name in (ROUTER, *([WRITE_POOL] if overlay in WRITE_POOL_OVERLAYS else [])):
        deployment = get(overlay, "Deployment", name)
        zone_spread(deployment)
        keys = {s["topologyKey"] for s in pod_spec(deployment)["topologySpreadConstraints"]}
        assert HOST in keys, name


def rbac_rules(docs: tuple[dict[str, Any], ...], account: str, namespace: str) -> list[dict[str, Any]]:
    """Every rule granted to a ServiceAccount through the (Cluster)RoleBindings of a render."""
    roles = {(o["kind"], o["metadata"]["name"]): o for o in docs if o["kind"] in ("Role", "ClusterRole")}
    out = []
    for binding in (o for o in docs if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if any(
            (s["kind"], s["name"], s.get("namespace", namespace)) == ("ServiceAccount", account, namespace)
            for s in binding["subjects"]
        ):
            ref = binding["roleRef"]
            assert (ref["kind"], ref["name"]) in roles, f"{binding['metadata']['name']} binds a missing role"
            rules = roles[(ref["kind"], ref["name"])]["rules"]
            out += [{**rule, "cluster": binding["kind"] == "ClusterRoleBinding"} for rule in rules]
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_bootstrap_pairs_masters_and_replicas_by_zone(overlay: str) -> None:
    """`redis-cli --cluster create` pairs by IP address, which tells nothing in Kubernetes (every pod
    has its own). The Job's init container (node-zones.py, on the router's image) reads each Redis
    pod's machine's zone label and hands the file to cluster-bootstrap.sh (REDIS_ZONES_FILE), which
    puts a master and its replicas in different zones (tests/test_k8s_scripts.py). Only that
    container holds an API token, and its account may read the StatefulSet, its pods and the
    nodes, nothing else; the cluster-wide objects carry the namespace in their names, so two
    installs in one cluster do not take each other's."""
    job = get(overlay, "Job", "redis-cluster-bootstrap")
    spec = pod_spec(job)
    (init,) = spec["initContainers"]
    boot = container(job, "bootstrap")
    assert init["command"] == ["python", "/scripts/node-zones.py"]
    assert init["image"] == container(get(overlay, "Deployment", ROUTER), "router")["image"]
    init_env = {e["name"]: e.get("value") for e in init["env"]}
    boot_env = {e["name"]: e.get("value") for e in boot["env"]}
    assert init_env["REDIS_STATEFULSET"] == REDIS
    zones_file = init_env["ZONES_FILE"]
    assert boot_env["REDIS_ZONES_FILE"] == zones_file
    mounts = {c["name"]: {m["name"]: m for m in c["volumeMounts"]} for c in (init, boot)}
    volumes = {v["name"]: v for v in spec["volumes"]}
    shared = [
        name
        for name, m in mounts[init["name"]].items()
        if zones_file.startswith(m["mountPath"].rstrip("/") + "/")
        and name in mounts["bootstrap"]
        and "emptyDir" in volumes[name]
    ]
    assert len(shared) == 1, "the init container writes the file where the bootstrap reads it"
    assert mounts[init["name"]]["scripts"]["mountPath"] == "/scripts"
    # the token: mounted in the init container only
    assert spec["automountServiceAccountToken"] is False
    tokens = [
        n
        for n, v in volumes.items()
        if any("serviceAccountToken" in source for source in v.get("projected", {}).get("sources", []))
    ]
    assert len(tokens) == 1
    assert mounts[init["name"]][tokens[0]]["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
    assert tokens[0] not in mounts["bootstrap"]
    # what the account may do: read the StatefulSet, list its pods, get nodes; nothing more
    namespace = NAMESPACES[overlay]
    account = spec["serviceAccountName"]
    (sa,) = [o for o in objects(overlay, "ServiceAccount") if o["metadata"]["name"] == account]
    assert sa["automountServiceAccountToken"] is False
    granted = {
        (group, resource, verb, rule["cluster"], tuple(rule.get("resourceNames", ())))
        for rule in rbac_rules(rendered(overlay), account, namespace)
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == {
        ("apps", "statefulsets", "get", False, (REDIS,)),
        ("", "pods", "list", False, ()),
        ("", "nodes", "get", True, ()),
    }
    for o in rendered(overlay):
        if o["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            assert namespace in o["metadata"]["name"], o["metadata"]["name"]
    # it reaches the API server (its address and port vary: 443 behind the Service, 6443 often
    # behind the DNAT), and still nothing else outside
    bootstrap = pod_labels(job)
    assert egress_outside(overlay, bootstrap, 443) and egress_outside(overlay, bootstrap, 6443)
    assert not egress_outside(overlay, bootstrap, 80) and not egress_outside(overlay, bootstrap, 6379)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_scripts_ship_from_the_files(overlay: str) -> None:
    cm = generated(overlay, "ConfigMap", "redis-cluster-scripts")
    files = {p.name: p.read_text() for p in (K8S / "base" / "redis").iterdir() if p.suffix in (".sh", ".py")}
    assert cm["data"] == files
    for owner in (get(overlay, "StatefulSet", REDIS), get(overlay, "Job", "redis-cluster-bootstrap")):
        volumes = {v["name"]: v for v in pod_spec(owner)["volumes"]}
        assert volumes["scripts"]["configMap"]["name"] == cm["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_bootstrap_job_lists_every_node(overlay: str) -> None:
    sts = get(overlay, "StatefulSet", REDIS)
    job = get(overlay, "Job", "redis-cluster-bootstrap")
    c = container(job, "bootstrap")
    assert c["command"] == ["bash", "/scripts/cluster-bootstrap.sh"]
    assert c["image"] == container(sts, "redis")["image"]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    nodes = env["REDIS_NODES"].replace(",", " ").split()
    replicas = sts["spec"]["replicas"]
    assert nodes == [f"{REDIS}-{i}.{sts['spec']['serviceName']}:6379" for i in range(replicas)]
    per_shard = int(env["REDIS_REPLICAS"]) + 1
    assert replicas % per_shard == 0 and replicas // per_shard >= 3
    assert pod_spec(job)["restartPolicy"] == "OnFailure"
    assert job["spec"]["ttlSecondsAfterFinished"] > 0  # so a later `kubectl apply` can re-create it


def redis_clients(overlay: str) -> list[dict[str, Any]]:
    """Pod owners whose pods carry the label that the Redis NetworkPolicy admits."""
    key, value = REDIS_CLIENT_LABEL
    return [o for o in pod_owners(overlay) if pod_labels(o).get(key) == value]


def redis_password_ref(c: dict[str, Any]) -> dict[str, Any]:
    ref = secret_env(c).get("REDIS_PASSWORD")
    assert ref is not None, f"{c['name']} has no REDIS_PASSWORD from a Secret"
    return ref


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_nodes_require_the_password_from_the_secret(overlay: str) -> None:
    c = container(get(overlay, "StatefulSet", REDIS), "redis")
    # required (not optional): a node never starts without it, and redis-node.sh refuses to as well
    assert redis_password_ref(c) == REDIS_SECRET
    # redis-cli in the pod (probes, `kubectl exec ... redis-cli`) authenticates with the same one
    env = {e["name"]: e for e in c["env"]}
    assert expand(c, env["REDISCLI_AUTH"]["value"], {"REDIS_PASSWORD": "p" * 64}) == "p" * 64
    assert "REDIS_PASSWORD" not in config_data(overlay, c)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_redis_client_has_the_password(overlay: str) -> None:
    clients = redis_clients(overlay)
    names = {o["metadata"]["name"] for o in clients}
    assert {ROUTER, "redis-cluster-bootstrap"} <= names, names
    for owner in clients:
        for c in containers(pod_spec(owner)):
            if c in pod_spec(owner).get("initContainers", []) and c["name"] == "zones":
                # the zones init container talks to the Kubernetes API, never to Redis: it holds
                # the API token and not the password
                assert "REDIS_PASSWORD" not in secret_env(c) and not c.get("envFrom")
                continue
            assert redis_password_ref(c) == REDIS_SECRET, f"{owner['metadata']['name']}/{c['name']}"
    # the router takes it in its URL, as redis://:PASSWORD@seed,seed,...; the ConfigMap holds no
    # password, and the client made from the URL carries it to every node it connects to
    from shardlb.connection import connect

    c = container(get(overlay, "Deployment", ROUTER), "router")
    raw = config_data(overlay, c)["SHARDLB_REDIS_URL"]
    assert raw.startswith("redis://:$(REDIS_PASSWORD)@"), raw
    client = connect(expand(c, raw, {"REDIS_PASSWORD": "e" * 64}))
    assert client.get_connection_kwargs()["password"] == "e" * 64
    for name, data in ((o["metadata"]["name"], o.get("data", {})) for o in objects(overlay, "ConfigMap")):
        assert not any(re.search(r"rediss?://[^\s/@,]*@", v) for v in data.values()), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_isolated_by_network_policies(overlay: str) -> None:
    for owner in pod_owners(overlay):
        labels = pod_labels(owner)
        for direction in ("Ingress", "Egress"):
            assert policies(overlay, labels, direction), f"{owner['metadata']['name']}: no {direction} policy"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_admit_the_redis_clients_only(overlay: str) -> None:
    redis = pod_labels(get(overlay, "StatefulSet", REDIS))
    router = pod_labels(get(overlay, "Deployment", ROUTER))
    bootstrap = pod_labels(get(overlay, "Job", "redis-cluster-bootstrap"))
    for source in (router, bootstrap, redis):
        assert admits(overlay, source, redis, 6379)
    assert admits(overlay, redis, redis, 16379)  # the cluster bus
    assert not admits(overlay, router, redis, 16379)
    assert not admits(overlay, None, redis, 6379)
    for owner in pod_owners(overlay):
        if owner["metadata"]["name"] != REDIS:
            labels = pod_labels(owner)
            assert admits(overlay, labels, redis, 6379) == (owner in redis_clients(overlay)), owner[
                "metadata"
            ]["name"]
    # every pod that resolves names may ask DNS; only the bootstrap the API server (its zones)
    for labels in (router, bootstrap, redis):
        assert egress_outside(overlay, labels, 53)
        assert egress_outside(overlay, labels, 443) == (labels == bootstrap)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_of_the_router(overlay: str) -> None:
    router = pod_labels(get(overlay, "Deployment", ROUTER))
    redis = pod_labels(get(overlay, "StatefulSet", REDIS))
    # the API is reached from anywhere (ingress controller, other namespaces), on its port only
    assert admits(overlay, None, router, ROUTER_PORT)
    assert admits(overlay, {"app": "any-pod"}, router, ROUTER_PORT)
    assert not admits(overlay, None, router, 9090)
    # and it talks to Redis, PostgreSQL (rebuilds, settlement, history, bans) and DNS only
    assert not admits(overlay, router, {"app": "any-pod"}, 6379)
    assert not admits(overlay, router, redis, 16379)
    assert not egress_outside(overlay, router, 6379)
    assert egress_outside(overlay, router, 5432) and egress_outside(overlay, router, 53)
    assert not egress_outside(overlay, router, 443)


@pytest.mark.parametrize("overlay", LOCUST_OVERLAYS)
def test_network_policy_of_locust(overlay: str) -> None:
    master = pod_labels(get(overlay, "Deployment", "locust-master"))
    worker = pod_labels(get(overlay, "Deployment", "locust-worker"))
    router = pod_labels(get(overlay, "Deployment", ROUTER))
    redis = pod_labels(get(overlay, "StatefulSet", REDIS))
    # the web UI has no login: no pod and nothing outside reaches it (kubectl port-forward does)
    for source in (None, router, worker, master, {"app": "any-pod"}):
        assert not admits(overlay, source, master, 8089), source
    # workers reach the master's port 5557, nobody else does; workers accept nothing
    assert admits(overlay, worker, master, 5557)
    for source in (None, router, {"app": "any-pod"}):
        assert not admits(overlay, source, master, 5557)
        assert not admits(overlay, source, worker, 5557)
    # Locust sends load to the router and nowhere else (never to Redis)
    for source in (master, worker):
        assert admits(overlay, source, router, ROUTER_PORT)
        assert not admits(overlay, source, redis, 6379)
        assert not admits(overlay, source, {"app": "any-pod"}, ROUTER_PORT)
        assert egress_outside(overlay, source, 53) and not egress_outside(overlay, source, ROUTER_PORT)


def render_locust_over_the_write_pool(tmp_path: Path) -> list[dict[str, Any]]:
    """The load test of a write pool's shape, as an operator composes it (k8s/README.md, step 5):
    prod-write-pool (the pool `shardlb plan` offered) plus the Locust component, as prod-loadtest adds
    it to prod, and components/locust-write-pool, which sends the score posts to the pool."""
    components = ", ".join(
        os.path.relpath(K8S / "components" / c, tmp_path) for c in ("locust", "locust-write-pool")
    )
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\n"
        "kind: Kustomization\n"
        f"resources: [{os.path.relpath(K8S / 'overlays' / WRITE_POOL_OVERLAYS[0], tmp_path)}]\n"
        f"components: [{components}]\n"
    )
    result = run(tool("kubectl"), *RENDER, str(tmp_path))
    assert result.returncode == 0, f"Locust over the write pool does not build:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.mark.parametrize("overlay", LOCUST_OVERLAYS)
def test_locust_may_drive_both_router_pools_and_nothing_else(overlay: str) -> None:
    """Locust's egress named the router's pods (component router) only, so a load test of the write
    pool's shape (game servers posting to shardlb-router-writes:8000, k8s/README.md "Sizing") had
    every connection to the pool dropped. Its policies let it reach both pools' API port, and still
    nothing else: not the archiver (same app name), not Redis, not another port."""
    router = pod_labels(get(overlay, "Deployment", ROUTER))
    pool = {**router, "app.kubernetes.io/component": "router-writes"}  # components/write-pool's pods
    archiver = pod_labels(get(overlay, "Deployment", ARCHIVER))
    redis = pod_labels(get(overlay, "StatefulSet", REDIS))
    for name in ("locust-master", "locust-worker"):
        source = pod_labels(get(overlay, "Deployment", name))
        for target in (router, pool):
            assert admits(overlay, source, target, ROUTER_PORT), (name, target)
            assert not admits(overlay, source, target, 9102), (name, target)
        for target in (archiver, redis, {**router, "app.kubernetes.io/component": "router-admin"}):
            for port in (ROUTER_PORT, 9102, 6379):
                assert not admits(overlay, source, target, port), (name, target, port)


def test_locust_reaches_the_write_pool_of_a_write_pool_load_test(tmp_path: Path) -> None:
    docs = render_locust_over_the_write_pool(tmp_path)
    owners = {o["metadata"]["name"]: o for o in docs if o["kind"] in POD_OWNERS}
    found = [o for o in docs if o["kind"] == "NetworkPolicy"]

    def allowed(source: dict[str, str], target: dict[str, str], port: int) -> bool:
        return admitted(found, source, target, port)

    pools = [pod_labels(owners[name]) for name in (ROUTER, WRITE_POOL)]
    for name in ("locust-master", "locust-worker"):
        source = pod_labels(owners[name])
        for target in pools:
            assert allowed(source, target, ROUTER_PORT), (name, target)
        for other, owner in owners.items():
            if other not in (ROUTER, WRITE_POOL) and not other.startswith("locust-"):
                for port in (ROUTER_PORT, 6379, 9102, 5432):
                    assert not allowed(source, pod_labels(owner), port), (name, other, port)


def test_a_write_pool_load_test_posts_the_scores_to_the_pool(tmp_path: Path) -> None:
    """Locust sent every request to its --host, so one test could not drive the write pool's shape
    (game servers post to the pool, players read from the main routers). With
    components/locust-write-pool every Locust process gets SHARDLB_WRITE_HOST, the pool's Service at
    its port, and --host stays the main routers; without it (dev, prod-loadtest) nothing changes."""
    docs = render_locust_over_the_write_pool(tmp_path)
    maps = {o["metadata"]["name"]: o.get("data", {}) for o in docs if o["kind"] == "ConfigMap"}
    services = {o["metadata"]["name"]: o for o in docs if o["kind"] == "Service"}
    pool_ports = {p["port"] for p in services[WRITE_POOL]["spec"]["ports"]}
    assert ROUTER_PORT in pool_ports
    for name in ("locust-master", "locust-worker"):
        deployment = next(o for o in docs if o["kind"] == "Deployment" and o["metadata"]["name"] == name)
        c = container(deployment, "locust")
        data: dict[str, str] = {}
        for source in c.get("envFrom", []):
            if "configMapRef" in source:
                data.update(maps[source["configMapRef"]["name"]])
        assert data["SHARDLB_WRITE_HOST"] == f"http://{WRITE_POOL}:{ROUTER_PORT}", name
        assert float(data["SHARDLB_TARGET_WRITES"]) > 0, "the component's other settings are kept"
        if name == "locust-master":
            assert arg_value(c["args"], "--host") == f"http://{ROUTER}:{ROUTER_PORT}"
    for overlay in LOCUST_OVERLAYS:
        for name in ("locust-master", "locust-worker"):
            c = container(get(overlay, "Deployment", name), "locust")
            assert "SHARDLB_WRITE_HOST" not in config_data(overlay, c), (overlay, name)


# ---------------------------------------------------------------- the archive


def postgres_secret_name(overlay: str) -> str:
    """The Secret holding SHARDLB_POSTGRES_URL: made by hand in prod, generated (name + hash) in dev."""
    if overlay in POSTGRES_OVERLAYS:
        name: str = generated(overlay, "Secret", POSTGRES_SECRET)["metadata"]["name"]
        return name
    return POSTGRES_SECRET


def arg_value(args: list[str], flag: str) -> str:
    """The value of `--flag=value` or `--flag value` in a container's args (exactly one of them)."""
    found = [a.partition("=")[2] for a in args if a.startswith(f"{flag}=")]
    found += [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    assert len(found) == 1, f"{flag} in {args}"
    return found[0]


def expand_arg(c: dict[str, Any], value: str, known: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command and args: any variable of the container's env."""
    defined = {e["name"] for e in c.get("env", [])}
    return re.sub(r"\$\((\w+)\)", lambda m: known[m.group(1)] if m.group(1) in defined else m.group(0), value)


def metrics_port(c: dict[str, Any]) -> int:
    """The port the archiver serves /metrics on (its --metrics-port), which must be a container port."""
    port = int(arg_value(c["args"], "--metrics-port"))
    assert container_port(c, port) == port
    return port


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_archiver_runs_in_every_overlay(overlay: str) -> None:
    from shardlb.cli import DELEGATED

    deployment = get(overlay, "Deployment", ARCHIVER)
    c = container(deployment, "archiver")
    # the image's `shardlb` with its archive subcommand, more than one at once, on the router's image
    assert c["command"] == ["shardlb", "archive"] and "archive" in DELEGATED
    assert c["image"] == container(get(overlay, "Deployment", ROUTER), "router")["image"]
    assert deployment["spec"]["replicas"] >= 2
    # each pod is its own consumer in the journals' group: its name is the pod's name
    env = {e["name"]: e for e in c["env"]}
    name = arg_value(c["args"], "--name")
    (variable,) = re.fullmatch(r"\$\((\w+)\)", name).groups()  # type: ignore[union-attr]
    assert env[variable]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # the Redis password from redis-auth, in the router's URL with the router's seeds
    assert redis_password_ref(c) == REDIS_SECRET
    router = container(get(overlay, "Deployment", ROUTER), "router")
    assert env["SHARDLB_REDIS_URL"]["value"] == config_data(overlay, router)["SHARDLB_REDIS_URL"]
    from shardlb.connection import connect

    client = connect(expand(c, env["SHARDLB_REDIS_URL"]["value"], {"REDIS_PASSWORD": "f" * 64}))
    assert client.get_connection_kwargs()["password"] == "f" * 64
    # PostgreSQL's URL from its Secret, required
    url = secret_env(c)["SHARDLB_POSTGRES_URL"]
    assert url == {"name": postgres_secret_name(overlay), "key": "SHARDLB_POSTGRES_URL"}
    # no HTTP server but the metrics one: both probes ask it
    port = metrics_port(c)
    for probe in ("livenessProbe", "readinessProbe"):
        http = c[probe]["httpGet"]
        assert http["path"] == "/metrics" and container_port(c, http["port"]) == port, probe
    # run like the router: same pod and container security settings
    router_spec = pod_spec(get(overlay, "Deployment", ROUTER))
    assert pod_spec(deployment)["securityContext"] == router_spec["securityContext"]
    assert c["securityContext"] == router["securityContext"]
    # a drain takes one archiver at a time, and the budget covers only archivers
    pdbs = [
        p
        for p in objects(overlay, "PodDisruptionBudget")
        if selects(p["spec"]["selector"], pod_labels(deployment))
    ]
    assert [p["metadata"]["name"] for p in pdbs] == [ARCHIVER]
    assert pdbs[0]["spec"]["maxUnavailable"] == 1
    for other in pod_owners(overlay):
        if other is not deployment:
            assert not selects(pdbs[0]["spec"]["selector"], pod_labels(other)), other["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_postgres_client_has_the_archive_url(overlay: str) -> None:
    key, value = POSTGRES_CLIENT_LABEL
    refs: dict[str, dict[str, Any]] = {}
    for owner in pod_owners(overlay):
        for c in containers(pod_spec(owner)):
            ref = secret_env(c).get("SHARDLB_POSTGRES_URL")
            if ref is not None:
                refs[owner["metadata"]["name"]] = ref
                # labelled, so that dev's PostgreSQL NetworkPolicy lets it in
                assert pod_labels(owner).get(key) == value, owner["metadata"]["name"]
                assert ref["name"] == postgres_secret_name(overlay) and ref["key"] == "SHARDLB_POSTGRES_URL"
    pool = {WRITE_POOL} if overlay in WRITE_POOL_OVERLAYS else set()
    assert set(refs) == {ROUTER, ARCHIVER, RECONCILE, BANDS, PRUNE, *pool}
    # the router runs without it (its archive endpoints then answer 409); the others need it
    assert all(refs[name].get("optional") is True for name in (ROUTER, *pool))
    assert not any(refs[name].get("optional") for name in (ARCHIVER, RECONCILE, BANDS, PRUNE))
    from router.settings import Settings

    url = "postgresql://shardlb:pw@db.example.com:5432/shardlb"
    parsed = Settings.from_env({"SHARDLB_INSECURE_DEV": "true", "SHARDLB_POSTGRES_URL": url})
    assert parsed.postgres_url == url


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_of_the_archive(overlay: str) -> None:
    archiver_owner = get(overlay, "Deployment", ARCHIVER)
    archiver = pod_labels(archiver_owner)
    reconcile = pod_labels(get(overlay, "CronJob", RECONCILE))
    bands = pod_labels(get(overlay, "CronJob", BANDS))
    prune = pod_labels(get(overlay, "CronJob", PRUNE))
    router = pod_labels(get(overlay, "Deployment", ROUTER))
    redis = pod_labels(get(overlay, "StatefulSet", REDIS))
    # they talk to Redis' client port, PostgreSQL (at any address: prod's is outside) and DNS only
    for source in (archiver, reconcile, bands, prune):
        assert admits(overlay, source, redis, 6379)
        assert not admits(overlay, source, redis, 16379)
        assert egress_outside(overlay, source, 5432) and egress_outside(overlay, source, 53)
        assert not egress_outside(overlay, source, 443) and not egress_outside(overlay, source, 6379)
        assert not admits(overlay, source, router, ROUTER_PORT)
        assert not admits(overlay, source, {"app": "any-pod"}, 6379)
    # the archiver's metrics: pods of its namespace and the monitoring namespace, that port only
    port = metrics_port(container(archiver_owner, "archiver"))
    assert admits(overlay, {"app": "prometheus"}, archiver, port)
    assert not admits(overlay, {"app": "prometheus"}, archiver, ROUTER_PORT)
    assert not admits(overlay, None, archiver, ROUTER_PORT)
    peers = [
        peer
        for p in policies(overlay, archiver, "Ingress")
        for rule in p["spec"].get("ingress", [])
        for peer in rule.get("from", [{"ipBlock": "anywhere"}])
    ]
    outside = [peer for peer in peers if "podSelector" not in peer]
    assert outside == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    # nothing connects to the reconcile, band starts and prune Jobs
    for source in (None, router, archiver, {"app": "any-pod"}):
        for job in (reconcile, bands, prune):
            assert not admits(overlay, source, job, port)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_reconcile_runs_nightly_one_at_a_time(overlay: str) -> None:
    cron = get(overlay, "CronJob", RECONCILE)
    assert len(cron["spec"]["schedule"].split()) == 5
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    c = container(cron, "reconcile")
    assert redis_password_ref(c) == REDIS_SECRET
    # the archiver's Redis URL (the router's seeds, test_the_archiver_runs_in_every_overlay)
    archiver = container(get(overlay, "Deployment", ARCHIVER), "archiver")
    assert config_data(overlay, c)["SHARDLB_REDIS_URL"] == config_data(overlay, archiver)["SHARDLB_REDIS_URL"]
    settings = config_data(overlay, c)
    assert {"SHARDLB_RECONCILE_BOARDS", "SHARDLB_RECONCILE_ARGS"} <= set(settings)


def job_script(tmp_path: Path, cron: str, name: str, status: str) -> Callable[..., tuple[int, list[str]]]:
    """The shell script of CronJob ``cron``'s container ``name``, run as the pod would, with a
    `shardlb` that records its arguments in the file ``$calls`` and exits with the status of the
    shell line ``status`` (e.g. `[ "$2" != broken ]`: 1 for the board named broken): a call (settings
    over the ConfigMap's) gives the exit status and the `shardlb` calls made."""
    c = container(get("prod", "CronJob", cron), name)
    assert c["command"][:2] == ["sh", "-c"]
    script = c["command"][2]
    log = tmp_path / "calls"
    stub = tmp_path / "shardlb"
    stub.write_text(f'#!/bin/sh\ncalls={log}\necho "$*" >> "$calls"\n{status}\n')
    stub.chmod(0o755)

    def job(**settings: str) -> tuple[int, list[str]]:
        log.write_text("")
        env = {**os.environ, **config_data("prod", c), "PATH": f"{tmp_path}:{os.environ['PATH']}", **settings}
        result = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=False)
        return result.returncode, log.read_text().splitlines()

    return job


def test_reconcile_job_checks_every_board_and_fails_on_any_drift(tmp_path: Path) -> None:
    run = job_script(tmp_path, RECONCILE, "reconcile", '[ "$2" != drifting ]')

    def job(boards: str, args: str = "") -> tuple[int, list[str]]:
        return run(SHARDLB_RECONCILE_BOARDS=boards, SHARDLB_RECONCILE_ARGS=args)

    assert job("") == (0, [])
    assert job("weekly daily-cup") == (0, ["reconcile weekly", "reconcile daily-cup"])
    code, calls = job("a drifting b", "--repair --period daily")
    assert code == 1
    assert calls == [f"reconcile {b} --repair --period daily" for b in ("a", "drifting", "b")]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_band_starts_job_runs_nightly_one_at_a_time(overlay: str) -> None:
    cron = get(overlay, "CronJob", BANDS)
    assert len(cron["spec"]["schedule"].split()) == 5
    assert cron["spec"]["schedule"] != get(overlay, "CronJob", RECONCILE)["spec"]["schedule"]
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    c = container(cron, "bands")
    assert redis_password_ref(c) == REDIS_SECRET
    archiver = container(get(overlay, "Deployment", ARCHIVER), "archiver")
    settings = config_data(overlay, c)
    assert settings["SHARDLB_REDIS_URL"] == config_data(overlay, archiver)["SHARDLB_REDIS_URL"]
    assert {"SHARDLB_BANDS_BOARDS", "SHARDLB_BANDS_ARGS"} <= set(settings)
    assert settings["SHARDLB_BANDS_BOARDS"] == ""  # nothing is resharded until boards are listed


def test_band_starts_job_applies_every_board_and_fails_on_any_failure(tmp_path: Path) -> None:
    run = job_script(tmp_path, BANDS, "bands", '[ "$2" != broken ]')

    def job(boards: str, args: str = "") -> tuple[int, list[str]]:
        return run(SHARDLB_BANDS_BOARDS=boards, SHARDLB_BANDS_ARGS=args)

    assert job("") == (0, [])
    # a board id may hold colons: the band count is after the last one
    assert job("global:3 season:2026:6") == (
        0,
        ["bands global --count 3 --apply", "bands season:2026 --count 6 --apply"],
    )
    code, calls = job("a:3 broken:3 b:4", "--skew 1.25")
    assert code == 1
    assert calls == [
        f"bands {b} --count {n} --apply --skew 1.25" for b, n in (("a", 3), ("broken", 3), ("b", 4))
    ]
    code, calls = job("nocount a: :3 b:2")  # malformed entries fail the Job; the rest still run
    assert code == 1 and calls == ["bands b --count 2 --apply"]


def daily_window(cron: dict[str, Any]) -> tuple[int, int]:
    """The minutes of the day from and until which (mod 1440) a daily CronJob's Jobs may run: its
    schedule, and then its Jobs' deadline."""
    minute, hour, *rest = cron["spec"]["schedule"].split()
    assert rest == ["*", "*", "*"] and cron["spec"]["timeZone"] == "Etc/UTC", cron["spec"]["schedule"]
    start = int(hour) * 60 + int(minute)
    deadline = cron["spec"]["jobTemplate"]["spec"]["activeDeadlineSeconds"]
    return start, (start + math.ceil(deadline / 60)) % 1440


def starts_within(minute: int, window: tuple[int, int]) -> bool:
    start, end = window
    return start <= minute < end if start < end else minute >= start or minute < end


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prune_runs_nightly_apart_from_the_other_jobs_one_at_a_time(
    overlay: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cron = get(overlay, "CronJob", PRUNE)
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    # its whole window (to its deadline) keeps clear of reconcile's and bands' starts, and theirs of its
    prune = daily_window(cron)
    for other in (RECONCILE, BANDS):
        theirs = daily_window(get(overlay, "CronJob", other))
        assert not starts_within(theirs[0], prune) and not starts_within(prune[0], theirs), other
    c = container(cron, "prune")
    assert redis_password_ref(c) == REDIS_SECRET
    archiver = container(get(overlay, "Deployment", ARCHIVER), "archiver")
    settings = config_data(overlay, c)
    assert settings["SHARDLB_REDIS_URL"] == config_data(overlay, archiver)["SHARDLB_REDIS_URL"]
    # run like the reconcile Job: same pod and container security settings, nothing mounted but /tmp
    reconcile = get(overlay, "CronJob", RECONCILE)
    assert pod_spec(cron)["securityContext"] == pod_spec(reconcile)["securityContext"]
    assert c["securityContext"] == container(reconcile, "reconcile")["securityContext"]
    assert [m["mountPath"] for m in c["volumeMounts"]] == ["/tmp"]
    # its calls' options are prune's own: its parser takes them and stops only at the missing URL
    from shardlb import prune as prune_module

    args = shlex.split(settings["SHARDLB_PRUNE_ARGS"])
    monkeypatch.delenv("SHARDLB_POSTGRES_URL", raising=False)
    with pytest.raises(SystemExit) as stopped:
        prune_module.main(args)
    assert stopped.value.code == 2 and "give --postgres" in capsys.readouterr().err
    # refused_results is kept for a bounded time: without --refused-days (prune keeps them all by
    # default) it grew for good under the nightly prune
    assert int(arg_value(args, "--refused-days")) >= 1
    # the moderation audit is kept for good unless the operator asks (an audit log's retention is
    # theirs to decide; k8s/README.md): the Job passes no --audit-days
    assert not any(a.startswith("--audit-days") for a in args), args
    # the budget stops the calls before the Job's deadline does (a failed Job), leaving room for the
    # pod's start and a last call of --limit rows at 10,000 rows/s (1,000,000 rows took 38-63 s on a
    # 2-core test machine, prune-cronjob.yaml)
    limit = int(arg_value(args, "--limit"))
    deadline = cron["spec"]["jobTemplate"]["spec"]["activeDeadlineSeconds"]
    budget = int(settings["SHARDLB_PRUNE_BUDGET_S"])
    assert budget > 0 and budget + 600 + limit / 10_000 <= deadline
    assert cron["spec"]["jobTemplate"]["spec"]["backoffLimit"] == 0


# a stub `shardlb`'s status: the word of EXITS at its call's number (the first call, the first word)
EXITS = 'set -- $EXITS; shift $(($(wc -l < "$calls") - 1)); exit "$1"'


def prune_default_call() -> str:
    settings = config_data("prod", container(get("prod", "CronJob", PRUNE), "prune"))
    return f"prune {settings['SHARDLB_PRUNE_ARGS']}"


def test_prune_job_calls_it_again_while_the_limit_stops_it_and_the_budget_lasts(tmp_path: Path) -> None:
    run = job_script(tmp_path, PRUNE, "prune", EXITS)
    assert run(EXITS="0", SHARDLB_PRUNE_ARGS="--grace 86400") == (0, ["prune --grace 86400"])
    # exit 3, --limit reached: run again at once, until nothing is left; the Job succeeds
    assert run(EXITS="3 3 0", SHARDLB_PRUNE_ARGS="--limit 5") == (0, ["prune --limit 5"] * 3)
    # the budget spent with rows left: no call more, and the Job succeeds (the next night goes on)
    assert run(EXITS="3 3 3", SHARDLB_PRUNE_BUDGET_S="0") == (0, [prune_default_call()])
    # the ConfigMap's options and budget by default
    assert run(EXITS="3 0") == (0, [prune_default_call()] * 2)


def test_prune_job_fails_on_any_other_status(tmp_path: Path) -> None:
    run = job_script(tmp_path, PRUNE, "prune", EXITS)
    # PostgreSQL or Redis unreachable (1), bad options (2): the Job fails with that status, no retry
    assert run(EXITS="1 0") == (1, [prune_default_call()])
    assert run(EXITS="3 2 0", SHARDLB_PRUNE_ARGS="--batch 0") == (2, ["prune --batch 0"] * 2)
    # a budget that is not a number of seconds runs nothing
    for budget in ("", "1h", "-5", "90 s"):
        assert run(EXITS="0", SHARDLB_PRUNE_BUDGET_S=budget) == (2, []), budget


@pytest.mark.parametrize(
    ("cron", "name", "setting", "boards"),
    [
        (RECONCILE, "reconcile", "SHARDLB_RECONCILE_BOARDS", "a b"),
        (BANDS, "bands", "SHARDLB_BANDS_BOARDS", "a:3 b:3"),
        (PRUNE, "prune", "SHARDLB_PRUNE_ARGS", "a b"),  # exit 3 (run it again) would not start another
    ],
)
def test_a_stopped_job_hands_sigterm_to_its_command_and_starts_no_other(
    tmp_path: Path, cron: str, name: str, setting: str, boards: str
) -> None:
    """Kubernetes stops a Job's pod (its deadline, a drain, a deletion) with SIGTERM to the pod's
    first process: the Job's shell. A shell there ignored it (PID 1 has no default action; any other
    shell died and left `shardlb` running): the command never had its clean-up, was killed 30 s
    later, and meanwhile the shell went on to the next board (or prune call)."""
    c = container(get("prod", "CronJob", cron), name)
    assert c["command"][:2] == ["sh", "-c"]
    log, pid = tmp_path / "calls", tmp_path / "pid"
    stub = tmp_path / "shardlb"
    stub.write_text(
        "#!/bin/sh\n"
        f"trap 'echo \"terminated $2\" >> {log}; exit 143' TERM\n"
        f'echo $$ > {pid}\necho "$*" >> {log}\n'
        "while :; do sleep 0.1; done\n"
    )
    stub.chmod(0o755)
    path = f"{tmp_path}:{os.environ['PATH']}"
    env = {**os.environ, **config_data("prod", c), "PATH": path, setting: boards}
    job = subprocess.Popen(["sh", "-c", c["command"][2]], env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (log.exists() and log.read_text()):
            assert time.monotonic() < deadline and job.poll() is None, "the first board never started"
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)
        code = job.wait(30)
        calls = log.read_text().splitlines()
        assert code == 143, calls
        assert [call.split()[:2] for call in calls] == [[name, "a"], ["terminated", "a"]]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        with contextlib.suppress(OSError, ValueError):  # the stub, if the shell left it running
            os.kill(int(pid.read_text()), signal.SIGKILL)


def test_dev_runs_its_own_postgres() -> None:
    sts = get("dev", "StatefulSet", POSTGRES)
    c = container(sts, "postgres")
    assert re.fullmatch(r"postgres:\d+\.\d+", c["image"]), "the official image, pinned"
    assert sts["spec"]["replicas"] == 1
    # the data lives on its volume, in a directory below the mount (whose root may hold lost+found)
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"]
    env = {e["name"]: e for e in c["env"]}
    mount = next(m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert env["PGDATA"]["value"].startswith(mount["mountPath"].rstrip("/") + "/")
    # the URL its clients get names this server, its user, database and password
    secret = generated("dev", "Secret", POSTGRES_SECRET)
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert secret_env(c)["POSTGRES_PASSWORD"] == {
        "name": secret["metadata"]["name"],
        "key": "POSTGRES_PASSWORD",
    }
    url = conninfo_to_dict(data["SHARDLB_POSTGRES_URL"])
    service = get("dev", "Service", sts["spec"]["serviceName"])
    assert url["host"] == service["metadata"]["name"]
    (port,) = service["spec"]["ports"]
    assert int(url["port"]) == port["port"] == container_port(c, port["targetPort"])
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(sts))
    assert (url["user"], url["dbname"]) == (env["POSTGRES_USER"]["value"], env["POSTGRES_DB"]["value"])
    assert url["password"] == data["POSTGRES_PASSWORD"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["exec"]["command"][0] == "pg_isready", probe
    # only the archive's clients reach it; it reaches nothing, not even DNS
    postgres = pod_labels(sts)
    clients = {ROUTER, ARCHIVER, RECONCILE, BANDS, PRUNE}
    for owner in pod_owners("dev"):
        if owner is not sts:
            allowed = admits("dev", pod_labels(owner), postgres, 5432)
            assert allowed == (owner["metadata"]["name"] in clients), owner["metadata"]["name"]
    assert not admits("dev", None, postgres, 5432)
    assert not egress_outside("dev", postgres, 53)


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o not in POSTGRES_OVERLAYS])
def test_prod_expects_an_external_postgres(overlay: str) -> None:
    for owner in pod_owners(overlay):
        for c in containers(pod_spec(owner)):
            assert not c["image"].startswith("postgres"), owner["metadata"]["name"]
    assert not [o for o in rendered(overlay) if o["metadata"]["name"].startswith(POSTGRES)]
    assert objects(overlay, "Secret") == []


@pytest.mark.cluster
async def test_the_archiver_container_runs_as_rendered(
    store: Any, cluster_url: str, postgres_url: str, tmp_path: Path
) -> None:
    """The rendered archiver container's command and args, run against the suite's cluster and
    PostgreSQL: it archives under the pod's name as its consumer name, answers its probes on the
    metrics port, and exits 0 on SIGTERM within the grace period."""
    from shardlb import keys, times
    from shardlb.board import Score
    from shardlb.config import BoardConfig
    from shardlb.connection import connect
    from shardlb.journal import GROUP

    deployment = get("prod", "Deployment", ARCHIVER)
    c = container(deployment, "archiver")
    pod = "shardlb-archiver-5d8f7c9b6-x2x4q"
    port = metrics_port(c)
    with socket.socket() as s:  # the test's own port: other test sessions may run beside this one
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    args = [expand_arg(c, a, {"POD_NAME": pod}) for a in c["args"]]
    args = [a.replace(f"--metrics-port={port}", f"--metrics-port={free}") for a in args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLB_")}
    env |= {"SHARDLB_REDIS_URL": cluster_url, "SHARDLB_POSTGRES_URL": postgres_url}

    config = BoardConfig.from_dict("k8s-archiver", {"sharding": {"strategy": "hash", "shards": 3}})
    board, _ = await store.create(config)
    raw = connect(cluster_url, decode=False)
    output = tmp_path / "archiver.log"
    with output.open("wb") as sink:
        process = subprocess.Popen(
            [tool(c["command"][0]), *c["command"][1:], *args], env=env, stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i, "m1", now) for i in range(20)], now_ms=now)
        journals = [keys.journal_key(p) for p in board.prefixes]
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, output.read_text()
            assert time.monotonic() < deadline, (
                "the archiver did not consume within 30 s:\n" + output.read_text()
            )
            consumers: set[bytes] = set()
            for key in journals:
                if await raw.exists(key):
                    groups = {g["name"] for g in await raw.xinfo_groups(key)}
                    if GROUP.encode() in groups:
                        consumers |= {x["name"] for x in await raw.xinfo_consumers(key, GROUP)}
            if pod.encode() in consumers:
                break
            await asyncio.sleep(0.2)
        # what the probes see: 200 from /metrics, with the archive's own metrics
        http = c["livenessProbe"]["httpGet"]
        with urllib.request.urlopen(f"http://127.0.0.1:{free}{http['path']}", timeout=5) as reply:
            assert reply.status == 200
            names = {family.name for family in text_string_to_metric_families(reply.read().decode())}
        lags = ("entries", "results", "seconds")
        assert {f"shardlb_archive_lag_{lag}" for lag in lags} <= names
        process.send_signal(signal.SIGTERM)
        grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
        assert await asyncio.to_thread(process.wait, grace) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        await raw.aclose()
        await store.delete(config.id)


# ---------------------------------------------------------------- Locust


def image_locustfile() -> str:
    """Where the image puts the locustfile installed with the bench package (Dockerfile, builder)."""
    builder = dockerfile_stages()[0]
    links = [
        re.search(r"ln -s .+?/bench/locustfile\.py\"? +(\S+)", i) for i in builder if i.startswith("RUN ")
    ]
    found = [m.group(1) for m in links if m]
    assert len(found) == 1, "the builder links the installed bench/locustfile.py to a fixed path"
    path = found[0]
    assert any(f"test -f {path}" in i for i in builder), "the build fails when the link points nowhere"
    assert path.startswith("/opt/venv/"), "inside the virtualenv that the final stage copies"
    return path


@pytest.mark.parametrize("overlay", LOCUST_OVERLAYS)
def test_locust_runs_the_locustfile_of_its_image(overlay: str) -> None:
    # The locustfile imports bench.shapes and bench.workload from the image; running the image's
    # own copy keeps the three in step, and nothing outside k8s/ is read at render time.
    path = image_locustfile()
    assert not [o for o in objects(overlay, "ConfigMap") if o["metadata"]["name"].startswith("locustfile")]
    for name in ("locust-master", "locust-worker"):
        c = container(get(overlay, "Deployment", name), "locust")
        assert f"--locustfile={path}" in c["args"], c["args"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'packages = \[[^]]*"bench"', pyproject), "the wheel ships the bench package"


@pytest.mark.parametrize("overlay", LOCUST_OVERLAYS)
def test_locust_targets_the_router(overlay: str) -> None:
    master = get(overlay, "Deployment", "locust-master")
    worker = get(overlay, "Deployment", "locust-worker")
    mc, wc = container(master, "locust"), container(worker, "locust")
    assert mc["command"] == wc["command"] == ["locust"]
    assert mc["image"] == wc["image"] == container(get(overlay, "Deployment", ROUTER), "router")["image"]
    assert f"--host=http://{ROUTER}:{ROUTER_PORT}" in mc["args"]
    assert "--master" in mc["args"] and "--worker" in wc["args"]
    service = get(overlay, "Service", "locust-master")
    assert {p["port"] for p in service["spec"]["ports"]} == {8089, 5557}
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(master))
    assert not selects({"matchLabels": service["spec"]["selector"]}, pod_labels(worker))
    assert "--master-host=locust-master" in wc["args"] and "--master-port=5557" in wc["args"]
    for c in (mc, wc):
        assert float(config_data(overlay, c)["SHARDLB_TARGET_WRITES"]) > 0


@pytest.mark.parametrize("overlay", LOCUST_OVERLAYS)
def test_the_locust_master_keeps_each_rows_history_for_the_ramps_plateau(overlay: str) -> None:
    # The ramp's plateau is read from the per-second history of the `WRITE player-scores` row
    # (bench/locust_csv.py); Locust's web UI serves it (/stats/requests_full_history/csv,
    # k8s/README.md step 5) only from a master started with --csv and --csv-full-history, into a
    # folder it may write: the root file system is read-only. Without them the UI's charts add the
    # POST and WRITE rows up, and the stats CSV has the whole run's averages (until 2026-12-07).
    master = get(overlay, "Deployment", "locust-master")
    c = container(master, "locust")
    assert "--csv-full-history" in c["args"], c["args"]
    prefix = next((a.split("=", 1)[1] for a in c["args"] if a.startswith("--csv=")), None)
    assert prefix is not None, c["args"]
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod_spec(master)["volumes"]}
    folder = str(Path(prefix).parent)
    assert folder in mounts and "emptyDir" in volumes[mounts[folder]], (prefix, mounts)
    readme = (K8S / "README.md").read_text()
    assert "localhost:8089/stats/requests_full_history/csv" in readme


# ---------------------------------------------------------------- overlays and docs


def test_overlay_sizes() -> None:
    dev_hpa = get("dev", "HorizontalPodAutoscaler", ROUTER)["spec"]
    prod_hpa = get("prod", "HorizontalPodAutoscaler", ROUTER)["spec"]
    assert dev_hpa["minReplicas"] == 2
    assert prod_hpa["minReplicas"] > dev_hpa["minReplicas"]
    assert prod_hpa["maxReplicas"] > dev_hpa["maxReplicas"]
    dev_redis = get("dev", "StatefulSet", REDIS)
    prod_redis = get("prod", "StatefulSet", REDIS)
    assert dev_redis["spec"]["replicas"] == 6
    assert prod_redis["spec"]["replicas"] >= dev_redis["spec"]["replicas"]

    def gib(quantity: str) -> float:
        units = {"Mi": 1 / 1024, "Gi": 1, "Ti": 1024}
        number, unit = re.fullmatch(r"(\d+)(\w+)", quantity).groups()  # type: ignore[union-attr]
        return int(number) * units[unit]

    def memory(sts: dict[str, Any]) -> float:
        return gib(container(sts, "redis")["resources"]["limits"]["memory"])

    def storage(sts: dict[str, Any]) -> float:
        return gib(sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"])

    assert memory(prod_redis) > memory(dev_redis) and storage(prod_redis) > storage(dev_redis)
    # maxmemory leaves the head room below the container's memory limit that `shardlb plan` counts
    # (bench/plan.py, FORK_HEADROOM): an AOF rewrite or a replica sync forks, and under writes the
    # fork may copy every page; a node past its limit is OOM-killed (a failover, then a full sync)
    from bench.plan import FORK_HEADROOM

    for overlay in OVERLAYS:
        sts = get(overlay, "StatefulSet", REDIS)
        maxmemory = config_data(overlay, container(sts, "redis"))["REDIS_MAXMEMORY"]
        assert maxmemory.endswith("mb")
        assert int(maxmemory[:-2]) / 1024 * FORK_HEADROOM <= memory(sts), overlay


def test_readme_states_the_facts_the_tests_check() -> None:
    readme = (K8S / "README.md").read_text()
    assert f"Kubernetes {KUBERNETES_VERSION}" in readme
    assert "kubectl apply -k k8s/overlays/" in readme
    for doc in (ROOT / "README.md", *K8S.rglob("*.md"), *K8S.rglob("*.yaml")):
        assert "LoadRestrictionsNone" not in doc.read_text(), doc
    prod_max = get("prod", "HorizontalPodAutoscaler", ROUTER)["spec"]["maxReplicas"]
    assert re.search(rf"\b{prod_max}\b routers", readme), "the prod maximum is documented"
    for secret in secret_examples():
        assert re.search(rf"kubectl (-n \S+ )?create secret generic {secret}", readme), secret
    for needle in ("--cluster add-node", "--cluster rebalance", "shardlb plan --players"):
        assert needle in readme, needle


def test_the_locust_cleanup_selector_finds_every_object_prod_loadtest_adds() -> None:
    # k8s/README.md, step 5: back on prod, `kubectl delete deployment,service,configmap,networkpolicy
    # -l app.kubernetes.io/name=locust` must remove all that prod-loadtest added over prod (the
    # shardlb-bench-keys Secret, never rendered, is deleted by name). The generated locust-config
    # ConfigMap used to lack the label and stayed behind.
    prod = {(o["kind"], o["metadata"]["name"]) for o in rendered("prod")}
    added = [o for o in rendered("prod-loadtest") if (o["kind"], o["metadata"]["name"]) not in prod]
    assert {o["kind"] for o in added} == {"Deployment", "Service", "ConfigMap", "NetworkPolicy"}
    for o in added:
        labels = o["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/name") == "locust", f"{o['kind']}/{o['metadata']['name']}"


def _restarted(runbook: str, overlay: str) -> set[tuple[str, str]]:
    """The (kind, name) of every rendered object a `kubectl rollout restart` of ``runbook`` restarts:
    named (`deployment/shardlb-router`) or chosen by a selector (`deployment -l key=value,...`)."""
    kinds = {"deployment": "Deployment", "statefulset": "StatefulSet", "daemonset": "DaemonSet"}
    out: set[tuple[str, str]] = set()
    for found in re.finditer(r"rollout restart ([^`\n#]+)", runbook):
        words = found[1].split()
        given = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("-l", "--selector")]
        selector = dict(pair.split("=", 1) for pairs in given for pair in pairs.split(","))
        for word in words:
            kind, _, name = word.partition("/")
            if kind not in kinds:
                continue
            for o in objects(overlay, kinds[kind]):
                labels = o["metadata"].get("labels", {})
                if name:
                    chosen = o["metadata"]["name"] == name
                else:
                    chosen = bool(selector) and all(labels.get(k) == v for k, v in selector.items())
                if chosen:
                    out.add((o["kind"], o["metadata"]["name"]))
    return out


def _readers_of(overlay: str, secret: str, keys: set[str] | None = None) -> set[tuple[str, str]]:
    """The long-running pod owners whose containers take ``secret`` (those of its ``keys``, when
    given) into their environment at their start; a Job's or CronJob's pod reads it anew at each run."""
    out = set()
    for o in rendered(overlay):
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in containers(pod_spec(o)):
            whole = any(e.get("secretRef", {}).get("name") == secret for e in c.get("envFrom", []))
            refs = [e["valueFrom"].get("secretKeyRef") for e in c.get("env", []) if "valueFrom" in e]
            refs = [r for r in refs if r]
            if whole or any(r["name"] == secret and (keys is None or r["key"] in keys) for r in refs):
                out.add((o["kind"], o["metadata"]["name"]))
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_rotation_runbooks_restart_every_pod_that_reads_the_secret(overlay: str) -> None:
    # k8s/README.md, step 2: a rotated API key or Redis password reaches a pod at its start, so the
    # runbook restarts every Deployment that reads the Secret (the Redis nodes in step c of their
    # own). Both restarted shardlb-router (and the archivers) by name: on prod-write-pool the write
    # pool, shardlb-router-writes, kept the old keys, and after the nodes' restart with the new
    # password alone it could no longer reach Redis (until 2026-12-07).
    readme = (K8S / "README.md").read_text()
    keys = readme.split("To rotate an API key:", 1)[1].split("\n\n", 1)[0].replace("\n", " ")
    password = readme.split("To rotate the Redis password", 1)[1].split("```", 2)[1]
    api_keys = {"SHARDLB_ADMIN_KEYS", "SHARDLB_WRITE_KEYS", "SHARDLB_READ_KEYS"}
    key_readers = _readers_of(overlay, SECRET, api_keys)
    password_readers = _readers_of(overlay, REDIS_SECRET["name"])
    assert ("Deployment", ROUTER) in key_readers & password_readers  # the scan finds them
    assert sorted(key_readers - _restarted(keys, overlay)) == []
    assert sorted(password_readers - _restarted(password, overlay)) == []  # the nodes: step c
