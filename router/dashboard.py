"""GET /dashboard: the operator's page, three static files shipped inside the router package.

The files hold no data and need no key: the page asks for the admin key, keeps it in the tab's
sessionStorage and sends it as the Authorization header of its fetches to the API. Every file is
sent with a Content-Security-Policy that allows scripts, styles and connections to this origin only
and no inline script, so even a player id that got past the API's id checks and into the page as
markup could not run; app.js also only ever sets text, never HTML.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router import params
from router.errors import ApiError

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
TYPES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
ASSETS = tuple(name for name in TYPES if name != "index.html")


def _read(name: str) -> bytes:
    return (resources.files("router") / "static" / "dashboard" / name).read_bytes()


# Read once at import: a missing file fails the router's start, not an operator's first visit.
FILES = {name: _read(name) for name in TYPES}


def _file(name: str) -> Response:
    return Response(FILES[name], headers={**HEADERS, "content-type": TYPES[name]})


async def page(request: Request) -> Response:
    params.query(request.scope["query_string"], frozenset())
    return _file("index.html")


async def asset(request: Request) -> Response:
    params.query(request.scope["query_string"], frozenset())
    name = request.path_params["asset"]
    if name not in ASSETS:
        raise ApiError(404, "not_found", "no such dashboard file")
    return _file(name)


ROUTES = [
    Route("/dashboard", page, methods=["GET"]),
    Route("/dashboard/", page, methods=["GET"]),  # as typed; the page's links are absolute
    Route("/dashboard/{asset}", asset, methods=["GET"]),
]
