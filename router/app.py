"""The Starlette application: routes, the one middleware, error handlers and the worker lifespan."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

from redis import exceptions as rx
from redis.utils import HIREDIS_AVAILABLE
from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router import admin, dashboard, heap, liveness, logs, metrics, probes, routes, scores, settlements
from router.errors import ApiError, to_api_error
from router.gate import Admission
from router.hot import HotTop
from router.media import Unchanging, error_response
from router.middleware import Observe
from router.openapi import SPEC
from router.scores import ScoresEndpoint
from router.service import Service
from router.settings import Settings
from shardlb import compat
from shardlb.connection import redacted
from shardlb.errors import ClusterUnavailable, ShardlbError

log = logging.getLogger("shardlb.router")
HIREDIS_WARNING = (
    "hiredis is NOT available: redis-py falls back to its pure-Python reply parser, several times "
    "slower; install hiredis>=3.2 (pip install 'redis[hiredis]')"
)
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


async def _api_error(request: Request, exc: Exception) -> Response:
    error = to_api_error(exc)
    if error.status >= 500:
        request.state.cause = exc  # the access middleware logs its traceback with the request id
    return error_response(request, error)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    message = "no such route" if exc.status_code == 404 else str(exc.detail)
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        allow = _allowed(request)
        headers["Allow"] = ", ".join(allow)
        message = f"{request.method} is not allowed here; this path takes {', '.join(allow)}"
    return error_response(request, ApiError(exc.status_code, code, message, headers=headers))


def _allowed(request: Request) -> list[str]:
    """Every method that some route takes at the request's path. Starlette's 405 names those of
    the first route that matched the path only: on `/v1/boards/x:rebuild`, the action's POST, not
    the GET, PUT and DELETE of the board "x:rebuild" (ids may hold ':'), until 2026-12-06."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


class Direct:
    """A route's handler as a plain ASGI app: the request, the handler, and the errors rendered as
    the app's exception handlers render them (anything else is left to the access middleware's
    last-resort 500, as on Starlette's path)."""

    def __init__(self, handler: Callable[[Request], Awaitable[Response]]) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await self.handler(request)
        except HTTPException as e:
            response = await _http_error(request, e)
        except (ApiError, ShardlbError, rx.RedisError, rx.RedisClusterException) as e:
            response = await _api_error(request, e)
        await response(scope, receive, send)


class AppState(State):
    """``app.state`` with its values where Python's own attribute lookup finds them. Starlette's
    State keeps them in a dict that only its ``__getattr__`` reads, and Python calls that once the
    usual lookup has failed (an AttributeError made and dropped first): some 5,000 instructions a
    read, and a write read the service twice (the access middleware's key check, the endpoint).
    Here that dict is the object's own ``__dict__``: State's behaviour is the same (a name never
    set is an AttributeError, item access reads the same values), its reads a plain lookup."""

    def __init__(self) -> None:
        super().__init__(self.__dict__)


class RouterApp(Starlette):
    """Starlette, plus short ways in for the hottest requests: a POST to /v1/boards/{board}/scores
    goes straight to the write endpoint inside the access middleware (router/scores.py), and a GET
    of a board's top or of one player ("my rank") straight to its handler (``Direct``), past
    Starlette's exception middlewares, router and per-route wrappers, which cost as much CPU as a
    cached read itself (and a top asked again within its second, past the handler too:
    router/hot.py). Every other request takes Starlette's path."""

    def __init__(self, observe: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(middleware=[Middleware(Observe, **observe)], **kwargs)
        self.state = AppState()
        self._scores_route = self._route(scores.PATH)
        self._scores = Observe(ScoresEndpoint(), **observe)
        # (pattern, path-parameter names, route for the metrics' labels, the handler in the middleware)
        self._gets = [
            (pattern, names, self._route(path), Observe(self._direct(handler), **observe))
            for pattern, names, path, handler in routes.HOT_GETS
        ]

    @staticmethod
    def _direct(handler: Callable[[Request], Awaitable[Response]]) -> ASGIApp:
        # The top's repeats are answered from their rendered bytes (router/hot.py).
        app = Direct(handler)
        return HotTop(app, routes.admit_read) if handler is routes.top else app

    @staticmethod
    def _route(path: str) -> BaseRoute:
        return next(r for r in routes.ROUTES if getattr(r, "path", None) == path)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            method = scope["method"]
            if method == "POST":
                match = scores.PATH_PATTERN.fullmatch(scope["path"])
                if match is not None:
                    scope["app"] = self
                    scope["route"] = self._scores_route
                    scope["path_params"] = {"board": match[1]}
                    await self._scores(scope, receive, send)
                    return
            elif method == "GET":
                for pattern, names, route, app in self._gets:
                    match = pattern.fullmatch(scope["path"])
                    if match is not None:
                        scope["app"] = self
                        scope["route"] = route
                        scope["path_params"] = dict(zip(names, match.groups(), strict=True))
                        await app(scope, receive, send)
                        return
        elif scope["type"] == "lifespan":
            send = self._told_start_failure(send)
        await super().__call__(scope, receive, send)

    def _told_start_failure(self, send: Send) -> Send:
        """``send`` for the lifespan, without the traceback Starlette puts in a failed start's
        message (uvicorn logs it) when the lifespan has already logged why in one line."""

        async def told(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed" and getattr(self.state, "start_failure", None):
                message = {**message, "message": ""}
            await send(message)

        return told


async def _start_unless_stopped(settings: Settings) -> Service | None:
    """``Service.start``, or None when SIGTERM or SIGINT comes while it waits for the cluster (up
    to SHARDLB_STARTUP_TIMEOUT_S). uvicorn's handlers only note a signal while the app starts, so a
    router asked to stop then went on waiting (in a pod: for the kubelet's SIGKILL); here each
    signal also ends the start, then goes to uvicorn's handler as before."""
    if threading.current_thread() is not threading.main_thread():
        return await Service.start(settings)  # no signal reaches this thread's loop
    loop = asyncio.get_running_loop()
    starting = asyncio.ensure_future(Service.start(settings))
    stopped = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopped
        stopped = True
        loop.call_soon_threadsafe(starting.cancel)
        handlers[signal.Signals(signum)](signum, frame)

    # Only signals that a handler catches (uvicorn's): one left to its default still ends the process.
    handlers = {
        sig: handler for sig in (signal.SIGINT, signal.SIGTERM) if callable(handler := signal.getsignal(sig))
    }
    for sig in handlers:
        signal.signal(sig, on_signal)
    try:
        return await starting
    except asyncio.CancelledError:
        if stopped and starting.cancelled():
            return None
        raise
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def create_app(settings: Settings | None = None) -> RouterApp:
    """The router app. Settings come from the environment when not given (uvicorn's factory call)."""
    settings = settings if settings is not None else Settings.from_env()
    logs.configure(settings.log_level)
    compat.mend_wait_for()  # each worker: a cancelled task must stop (shardlb/compat.py)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not HIREDIS_AVAILABLE:
            log.warning(HIREDIS_WARNING)
        try:
            service = await _start_unless_stopped(settings)
        except ClusterUnavailable as e:
            # One line that says why; RouterApp keeps Starlette's traceback of it out of the log.
            log.error(f"router cannot start: {e}", extra={"fields": {"pid": os.getpid()}})
            app.state.start_failure = e
            raise
        if service is None:
            # Nothing was served or accepted: uvicorn, which saw the signal too, stops at once.
            log.info("router stopped while starting", extra={"fields": {"pid": os.getpid()}})
            yield
            return
        app.state.service = service
        probe = None
        try:
            # liveness out of reach of the connection caps (router/liveness.py), from the moment
            # the worker serves to the end of its drain
            probe = await liveness.listen(settings)
            async with heap.settled():
                log.info(
                    "router ready",
                    extra={"fields": {"pid": os.getpid(), "redis_url": redacted(settings.redis_url)}},
                )
                yield
        finally:
            await app.state.service.stop()
            if probe is not None:
                probe.close()
            metrics.worker_exit(os.getpid())

    app = RouterApp(
        # Both ways in share one Admission: the bound is on everything the worker handles at once.
        observe={
            "access_log": settings.access_log,
            "admission": Admission(settings.max_requests),
            "proxies": settings.trusted_proxies,
            "open_access": settings.open_access,
        },
        # Settlement routes first: a POST to `/v1/boards/{board}:archive` must be tried before
        # `/v1/boards/{board}`, whose pattern also matches it (a board id may hold ':').
        routes=[*settlements.ROUTES, *routes.ROUTES, *probes.ROUTES, *admin.ROUTES, *dashboard.ROUTES],
        exception_handlers={
            ApiError: _api_error,
            ShardlbError: _api_error,
            rx.RedisError: _api_error,
            rx.RedisClusterException: _api_error,
            HTTPException: _http_error,
        },
        lifespan=lifespan,
    )
    # A trailing slash is another path, answered 404, not a redirect that clients would follow blindly.
    app.router.redirect_slashes = False
    app.state.openapi = Unchanging(SPEC)  # GET /openapi.json (router/probes.py)
    return app
