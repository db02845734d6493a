"""Write each Redis pod's zone for cluster-bootstrap.sh: the bootstrap Job's init container runs this.

cluster-bootstrap.sh pairs every replica with a master in another zone (plan_shards, redis-lib.sh),
but a pod cannot see its machine's labels, and the Redis image has no Kubernetes client. So this
reads them, on the shardlb image's Python (standard library only), with the Job's service account
(rbac.yaml: get the StatefulSet, list its pods, get nodes; nothing else): the StatefulSet's replica
count, then its pods until each is scheduled on a node, then each node's
topology.kubernetes.io/zone label. It writes `POD ZONE` per pod (ZONE empty for a node without
the label) to ZONES_FILE, which the bootstrap reads as REDIS_ZONES_FILE.

A pod not scheduled within ZONES_TIMEOUT seconds is left out (the bootstrap then plans it without
a zone, and waits for it anyway); an answer the API refuses (403: the RBAC objects missing) ends
the container with an error, so the Job fails where it can be seen instead of pairing blindly.

Settings (environment): ZONES_FILE (required), REDIS_STATEFULSET (redis-cluster), ZONES_TIMEOUT
(900), ZONES_POLL_INTERVAL (2); the API from KUBERNETES_SERVICE_HOST / KUBERNETES_SERVICE_PORT and
the service account's token, CA and namespace files, or, in tests, ZONES_API (a plain http://
base URL, no token) and ZONES_NAMESPACE.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ZONE_LABEL = "topology.kubernetes.io/zone"


def log(message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"{stamp} node-zones.py: {message}", file=sys.stderr, flush=True)


class Api:
    """GETs against the Kubernetes API as the pod's service account."""

    def __init__(self) -> None:
        test_url = os.environ.get("ZONES_API")
        if test_url:
            self.base, self.token, self.context = test_url.rstrip("/"), "", None
            self.namespace = os.environ["ZONES_NAMESPACE"]
            return
        host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        self.base = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        self.token = (ACCOUNT / "token").read_text().strip()
        self.context = ssl.create_default_context(cafile=str(ACCOUNT / "ca.crt"))
        self.namespace = (ACCOUNT / "namespace").read_text().strip()

    def get(self, path: str) -> Any:
        request = urllib.request.Request(self.base + path, headers={"Accept": "application/json"})
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(request, timeout=10, context=self.context) as response:
            return json.load(response)


def zones(api: Api, statefulset: str, deadline: float, interval: float) -> dict[str, str]:
    """Pod name -> its node's zone, for every pod of the StatefulSet scheduled by the deadline."""
    ns = urllib.parse.quote(api.namespace)
    sts = api.get(f"/apis/apps/v1/namespaces/{ns}/statefulsets/{urllib.parse.quote(statefulset)}")
    wanted = [f"{statefulset}-{i}" for i in range(int(sts["spec"].get("replicas", 1)))]
    selector = ",".join(f"{k}={v}" for k, v in sorted(sts["spec"]["selector"]["matchLabels"].items()))
    placed: dict[str, str] = {}
    while True:
        pods = api.get(f"/api/v1/namespaces/{ns}/pods?labelSelector={urllib.parse.quote(selector)}")
        placed = {
            p["metadata"]["name"]: p["spec"]["nodeName"]
            for p in pods.get("items", [])
            if p["metadata"]["name"] in wanted and p["spec"].get("nodeName")
        }
        missing = [pod for pod in wanted if pod not in placed]
        if not missing:
            break
        if time.monotonic() >= deadline:
            log(f"not scheduled in time, left without a zone: {' '.join(missing)}")
            break
        log(f"waiting for the scheduler to place: {' '.join(missing)}")
        time.sleep(interval)
    node_zone: dict[str, str] = {}
    for node in sorted(set(placed.values())):
        labels = api.get(f"/api/v1/nodes/{urllib.parse.quote(node)}")["metadata"].get("labels", {})
        node_zone[node] = labels.get(ZONE_LABEL, "")
    return {pod: node_zone[placed[pod]] for pod in wanted if pod in placed}


def main() -> int:
    out = Path(os.environ["ZONES_FILE"])
    timeout = float(os.environ.get("ZONES_TIMEOUT", "900"))
    interval = float(os.environ.get("ZONES_POLL_INTERVAL", "2"))
    deadline = time.monotonic() + timeout
    api = Api()
    while True:
        try:
            found = zones(api, os.environ.get("REDIS_STATEFULSET", "redis-cluster"), deadline, interval)
            break
        except urllib.error.HTTPError as e:
            if e.code < 500:
                log(f"the API refused {e.url}: {e.code} {e.reason} (is rbac.yaml applied?)")
                return 1
            problem = f"{e.code} {e.reason}"
        except (urllib.error.URLError, OSError) as e:
            problem = str(e)
        if time.monotonic() >= deadline:
            log(f"no answer from the API in time: {problem}")
            return 1
        log(f"the API did not answer ({problem}); trying again")
        time.sleep(interval)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(f"{pod} {zone}\n" for pod, zone in found.items()))
    tmp.replace(out)
    log("zones: " + ", ".join(f"{pod} {zone or '(none)'}" for pod, zone in found.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
