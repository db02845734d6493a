"""Service endpoints: liveness, readiness, Prometheus metrics and the OpenAPI document."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router import metrics
from router.auth import ANONYMOUS_CLIENT, client_network
from router.errors import ApiError
from router.limiter import SCRAPE_READS
from router.media import Unchanging, error_response, render
from router.routes import service


async def healthz(request: Request) -> Response:
    """The process is up and serving (no cluster call: a cluster outage must not restart routers)."""
    return render(request, {"status": "ok"})


async def readyz(request: Request) -> Response:
    """Ready when not draining, every primary answers, and all 16384 slots are served. The body
    also shows the journal nearest its bound, in results or entries not archived (it does not make
    the router unready: writes to that board's full shards are refused on their own), and the
    reshards under way and abandoned (router/reshards.py; nor do they)."""
    svc = service(request)
    problem = await svc.problem()
    if problem is not None:
        return error_response(request, ApiError(503, "not_ready", problem, retry_after=1))
    body = {"status": "ready", "journal": svc.journals.worst.body(), "reshards": svc.reshards.body()}
    return render(request, body)


async def prometheus(request: Request) -> Response:
    """The metrics text, for SCRAPE_READS of the client address's read tokens (a scraper every few
    seconds never notices; a flood of scrapes is 429 as a flood of reads is)."""
    peer = request.client.host if request.client else "unknown"
    wait = service(request).limiter.take(ANONYMOUS_CLIENT + client_network(peer), cost=SCRAPE_READS)
    if wait > 0:
        metrics.RATE_LIMITED.inc()
        message = "too many scrapes from this client; slow down"
        return error_response(request, ApiError(429, "rate_limited", message, retry_after=wait))
    body, content_type = metrics.render()
    return Response(body, headers={"content-type": content_type})


async def openapi(request: Request) -> Response:
    """The document, rendered once per app and format (``create_app``: ``app.state.openapi``):
    until 2026-12-06 every request rendered its 94 KB again, 0.35 ms as MessagePack, for anybody."""
    document: Unchanging = request.app.state.openapi
    return document.response(request)


ROUTES = [
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/metrics", prometheus, methods=["GET"]),
    Route("/openapi.json", openapi, methods=["GET"]),
]
