"""The docs and the router's routes agree: every `METHOD /path` the docs write (api.md, the READMEs,
docs/) is a route of `create_app()` that takes that method, and every route and method the router
serves is written so in router/README.md or api.md. So do the docs' calls to Locust's web UI and the
routes of the Locust installed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from starlette.routing import Route

from router.app import create_app
from router.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
API = ROOT.parent / "shared" / "api.md"
DOCS = [ROOT / "README.md", *(ROOT / d / "README.md" for d in ("router", "bench", "k8s"))]
DOCS += ROOT.glob("docs/*.md")
# `GET /v1/boards/{board}`, `POST/GET/DELETE /v1/admin/...`, `GET` `/healthz`
METHODS = "GET|HEAD|POST|PUT|PATCH|DELETE"
WRITTEN = re.compile(rf"\b((?:{METHODS})(?:/(?:{METHODS}))*)`? `?(/[\w{{}}/:.-]*)")


def _shape(path: str) -> str:
    """A path with each parameter as {}: /v1/boards/{id} and /v1/boards/BOARD are one route."""
    path = re.sub(r"\{[^}]*\}", "{}", path.rstrip(".:"))
    return re.sub(r"/(?:BOARD|rand\{\})(?=/|$)", "/{}", path)


def _served() -> dict[str, set[str]]:
    app = create_app(Settings(insecure_dev=True))  # the live app's routes
    return {
        _shape(route.path): {m for m in route.methods or () if m != "HEAD"}
        for route in app.routes
        if isinstance(route, Route)
    }


def _written(docs: list[Path]) -> dict[tuple[str, str], str]:
    """(method, path shape) of each route the docs write, with where it is written first."""
    out: dict[tuple[str, str], str] = {}
    for doc in docs:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for methods, path in WRITTEN.findall(line):
                if "..." in path or path.endswith("/"):  # `GET .../top`, a prefix
                    continue
                for method in methods.split("/"):
                    out.setdefault((method, _shape(path)), f"{doc.name}:{number}")
    return out


# api.md is beside the checkout (../shared), not in it: where a checkout has none, the docs of the
# repository are checked alone, and the routes served against router/README.md not at all.
WITH_API = [API] if API.exists() else []


def test_every_route_the_docs_write_is_served() -> None:
    served = _served()
    written = _written([*WITH_API, *DOCS])
    assert ("POST", "/v1/admin/boards/{}/reshard") in written  # the scan reads "POST/GET/DELETE"
    wrong = [
        f"{where}: {method} {path}"
        for (method, path), where in written.items()
        if method not in served.get(path, set())
    ]
    assert wrong == []


@pytest.mark.skipif(not API.exists(), reason="no ../shared/api.md beside this checkout")
def test_every_route_served_is_written_in_the_router_readme_or_api_md() -> None:
    written = _written([API, ROOT / "router" / "README.md"])
    served = [(method, path) for path, methods in _served().items() for method in methods]
    unwritten = sorted(route for route in served if route not in written)
    # The dashboard's files, each named in "Additions: dashboard" (a file name, not a route, there),
    # and its page under a trailing slash, written there too (a path ending in "/" reads as a prefix).
    assert unwritten == [("GET", "/dashboard/"), ("GET", "/dashboard/{}")]
    readme = (ROOT / "router" / "README.md").read_text()
    assert "`/dashboard/` serves the same page" in readme
    assets = sorted(p.name for p in (ROOT / "router" / "static" / "dashboard").iterdir())
    assert assets and [name for name in assets if f"`{name}`" not in readme] == []


# `curl -s -X POST -d user_count=1 localhost:8089/swarm`: a call to Locust's web UI (k8s/README.md,
# step 5, through `kubectl port-forward svc/locust-master 8089:8089`)
LOCUST_CALL = re.compile(r"\bcurl\b([^`\n]*?)\b(?:localhost|127\.0\.0\.1):8089(/[^\s`'\"]*)")
# Locust's web UI as the installed Locust builds it, never served: each call it refuses, with why.
# In a process of its own, as importing locust patches the interpreter with gevent.
LOCUST_ROUTES = """
import json, sys
from werkzeug.exceptions import HTTPException
from locust.env import Environment

urls = Environment().create_web_ui("127.0.0.1", 0, delayed_start=True).app.url_map.bind("localhost")
refused = {}
for method, path in json.load(sys.stdin):
    try:
        urls.match(path, method=method)
    except HTTPException as e:
        refused[f"{method} {path}"] = f"{e.code} {e.name}"
print(json.dumps(refused))
"""


def _locust_calls(docs: list[Path]) -> dict[str, str]:
    """`METHOD /path` of each call the docs make to Locust's web UI, with where it is written: the
    method of its -X, else POST where it sends a body (-d), else GET, as curl sends it."""
    out: dict[str, str] = {}
    for doc in docs:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for options, path in LOCUST_CALL.findall(line):
                given = re.search(r"(?:-X|--request)\s+([A-Z]+)", options)
                method = given[1] if given else "POST" if re.search(r"\s(?:-d|--data)\b", options) else "GET"
                out.setdefault(f"{method} {path}", f"{doc.relative_to(ROOT)}:{number}")
    return out


def test_every_call_to_locusts_web_ui_the_docs_write_is_one_it_serves() -> None:
    # Locust 2.47 serves /stop and /stats/reset to a POST alone (a GET: 405 Method Not Allowed);
    # the image installs the newest Locust that pyproject.toml allows, and k8s/README.md's `curl -s
    # localhost:8089/stop` (a GET) stopped nothing (until 2026-12-07).
    calls = _locust_calls(DOCS)
    assert {"POST /swarm", "GET /stats/requests/csv"} <= set(calls)  # the scan finds them
    done = subprocess.run(
        [sys.executable, "-c", LOCUST_ROUTES],
        input=json.dumps([call.split(" ", 1) for call in calls]),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    refused = json.loads(done.stdout)
    assert [f"{calls[call]}: {call}: {why}" for call, why in refused.items()] == []
