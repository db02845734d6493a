"""The one ASGI middleware: request ids, latency and status metrics, error log lines, last-resort 500,
the bound on requests at once, and the client's address behind a trusted proxy.

Pure ASGI (no BaseHTTPMiddleware, which costs a large share of throughput). Every response carries
``X-Request-Id`` (the client's, when it sent a sane one; on the calls whose retries it names, one
that is not sane is refused: ``retry_key``); every error response is logged as one JSON line with
that id, a refused one (4xx, 503) at debug but for a line a minute (``RefusedLines``);
access lines for every request only when SHARDLB_ACCESS_LOG is on. A request to
the API (``/v1/``) past SHARDLB_MAX_REQUESTS in progress is answered 503 at once; probes and metrics
always pass, so an overloaded router is not also restarted. When the peer is one of
SHARDLB_TRUSTED_PROXIES, ``scope["client"]`` becomes the address it forwarded (router/limiter.py).
A request whose body did not arrive within SHARDLB_BODY_TIMEOUT_S was answered 408 by the HTTP
protocol itself (router/http.py): it is logged and counted as that 408.

A request without a key (no Authorization) is answered 429 at once while its client (its address;
an IPv6 address's /64) holds 1/16 of SHARDLB_MAX_REQUESTS' slots already (at least 3): within its
read budget one client could otherwise hold every slot with slow reads. A request with a body and
without a key takes its admission slot at once, as any other, while its client has fewer than
BODY_SLOTS_PER_CLIENT such requests holding slots; past that, its body is read first, up to
SHARDLB_MAX_READ_BODY_BYTES (the most a request without a key may send), and the slot taken only
then. So one client sending bodies slowly holds at most that many slots (each at most the body
deadline), and its other requests, and everybody else's, still get in. A request with a key of
the write scope or above takes its slot at once: every route checks the key before it reads a body
(a wrong one is 401 at once), so only such a key holder can keep a slot waiting, and a game server
posting on many connections from one address pays nothing for the counts. A body sent with a read
key (or a wrong one) takes a body slot as one without a key does, though not the share of requests
in progress: a read key may go to whoever may read.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import re
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router import metrics
from router.auth import client_network
from router.errors import ApiError, shutting_down, to_api_error
from router.gate import Admission
from router.limiter import client_address
from router.media import TIMED_OUT, rendered_error, send_rendered, wants_msgpack
from router.settings import Network

log = logging.getLogger("shardlb.router")
_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")
REPLACED = "request_id_replaced"  # in a request's state: it sent an X-Request-Id that was not sane
BODY_SLOTS_PER_CLIENT = 2
# A log line keeps this much of a request's path: a 60 KB path must not make a 60 KB line.
LOGGED_PATH_CHARS = 200
# Refused requests (4xx, 503) are logged as one line this often at most per worker (RefusedLines).
REFUSALS_LOG_EVERY_S = 60.0
# The methods the latency histogram names; llhttp parses 34, and a series for each of them on every
# route would let anyone add thousands of series to a scrape: the rest are counted as "other".
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})
READ_AHEAD_BYTES = 96 * 1024  # when the app has no settings (SHARDLB_MAX_READ_BODY_BYTES' default)
# What a client without a key may hold of a worker's requests in progress (SHARDLB_MAX_REQUESTS):
# this fraction of them, at least one.
REQUESTS_SHARE_PER_CLIENT = 16
# Requests with a body holding a slot, and requests in progress, of clients without a key, by
# client, for each Admission (shared by the Observes of one app as the Admission is).
_BODIES: weakref.WeakKeyDictionary[Admission, dict[str, int]] = weakref.WeakKeyDictionary()
_REQUESTS: weakref.WeakKeyDictionary[Admission, dict[str, int]] = weakref.WeakKeyDictionary()


class Observe:
    def __init__(
        self,
        app: ASGIApp,
        access_log: bool = False,
        admission: Admission | None = None,
        proxies: Sequence[Network] = (),
        open_access: bool = False,
    ) -> None:
        self.app = app
        self.access_log = access_log
        self.open_access = open_access  # SHARDLB_INSECURE_DEV without keys: every request is admin
        self.admission = admission  # shared by every Observe of one app
        self.bodies = {} if admission is None else _BODIES.setdefault(admission, {})
        self.requests = {} if admission is None else _REQUESTS.setdefault(admission, {})
        # At least one more than a client's body slots: its stalled bodies leave it a request.
        share = 0 if admission is None else admission.limit // REQUESTS_SHARE_PER_CLIENT
        self.per_client = max(BODY_SLOTS_PER_CLIENT + 1, share)
        self.proxies = tuple(proxies)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        request_id, replaced = _request_id(scope)
        state: dict[str, Any] = scope.setdefault("state", {})
        state["request_id"] = request_id
        if replaced:
            state[REPLACED] = True
        status = 0
        if self.proxies:
            _forwarded_client(scope, self.proxies)

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        failure: BaseException | None = None
        try:
            if self.open_access and scope["method"] not in ("GET", "HEAD") and _from_another_site(scope):
                # Without keys nothing tells the operator's requests from a web page's: a page on any
                # site the developer visits may POST to the router on their laptop with no preflight
                # (fetch's no-cors mode, a body without a type, read as JSON). Browsers say where a
                # request comes from; curl and the clients send no Origin.
                error = ApiError(
                    403,
                    "forbidden",
                    "this router runs without keys (SHARDLB_INSECURE_DEV): it takes no request that "
                    "a browser sends from another site",
                )
                state["error"] = error
                await send_rendered(send_with_id, rendered_error(error, _wants_msgpack(scope)))
            elif self.admission is None or not scope["path"].startswith("/v1/"):
                await self.app(scope, receive, send_with_id)
            else:
                authorization, body = _head(scope["headers"])
                body = body and scope["method"] not in ("GET", "HEAD")
                if authorization is not None:
                    if body and not _may_write(scope, authorization):
                        # A read key's body (or a wrong key's) takes a body slot as one without a
                        # key does; its reads are not held to the share of requests in progress.
                        await self._with_body(self.admission, scope, receive, send_with_id, state, False)
                    else:
                        with self.admission:
                            await self.app(scope, receive, send_with_id)
                elif body:
                    await self._with_body(self.admission, scope, receive, send_with_id, state, True)
                else:  # _admit inlined: the cached reads pass here, a coroutine less each
                    client = scope.get("client")
                    address = body_client(client[0] if client else "")
                    requests = self.requests
                    held = requests.get(address, 0)
                    if held >= self.per_client:
                        await self._busy(scope, send_with_id, state)
                    else:
                        requests[address] = held + 1
                        try:
                            with self.admission:
                                await self.app(scope, receive, send_with_id)
                        finally:
                            _less(requests, address)
        except Exception as e:
            failure = e
            if status == 0:  # nothing sent yet: the client still gets a proper error body
                error = to_api_error(e)
                state["error"] = error
                status = error.status
                await send_rendered(send_with_id, rendered_error(error, _wants_msgpack(scope)))
        except asyncio.CancelledError:
            # uvicorn cancels the requests still running when its graceful shutdown runs out, and
            # would answer them a plain-text 500: they are told to retry elsewhere instead (a write's
            # accepted scores are still applied by the drain, so the retry is one call's state).
            if status == 0:
                error = shutting_down()
                state["error"] = error
                status = error.status
                await send_rendered(send_with_id, rendered_error(error, _wants_msgpack(scope)))
            raise
        finally:
            timed_out = state.get(TIMED_OUT)
            if timed_out is not None:  # answered by router/http.py; the app's own answer was dropped
                state["error"] = timed_out
                status = timed_out.status
            elapsed = time.perf_counter() - start
            route = getattr(scope.get("route"), "path", "unmatched")
            method = scope["method"]
            _timer(method if method in METHODS else "other", route)(elapsed)
            _counter(route, status)(1)
            if status >= 400 or failure is not None or self.access_log:
                self._log(
                    scope, request_id, status, elapsed, state.get("error"), failure or state.get("cause")
                )

    async def _with_body(
        self,
        admission: Admission,
        scope: Scope,
        receive: Receive,
        send: Send,
        state: dict[str, Any],
        shared: bool,
    ) -> None:
        """Admit a request that has a body and no key of the write scope: at once while its client
        holds fewer than BODY_SLOTS_PER_CLIENT slots with bodies, else once its body has arrived, or
        as much of it as a request without a key may send (a larger body is then refused at once by
        a public route, and read on by a keyed one). A body read ahead holds no slot while it
        arrives. ``shared``: the request has no key, and is held to its client's share of the
        requests in progress too (``_admit``)."""
        client = scope.get("client")
        address = body_client(client[0] if client else "")
        held = self.bodies.get(address, 0)
        if held >= BODY_SLOTS_PER_CLIENT:
            receive = await _read_ahead(receive, _read_ahead_bytes(scope))
            if TIMED_OUT not in state:  # else router/http.py has answered 408 already
                await self._enter(admission, address, scope, receive, send, state, shared)
            return
        self.bodies[address] = held + 1
        try:
            await self._enter(admission, address, scope, receive, send, state, shared)
        finally:
            _less(self.bodies, address)

    async def _enter(
        self,
        admission: Admission,
        address: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        state: dict[str, Any],
        shared: bool,
    ) -> None:
        if shared:
            await self._admit(admission, address, scope, receive, send, state)
        else:
            with admission:
                await self.app(scope, receive, send)

    async def _admit(
        self,
        admission: Admission,
        address: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        state: dict[str, Any],
    ) -> None:
        """Admit a request without a key while its client holds fewer than ``per_client`` slots, else
        429 at once: within its read budget a client could otherwise hold every slot of the worker
        with slow reads, and everyone else's requests would be 503."""
        held = self.requests.get(address, 0)
        if held >= self.per_client:
            await self._busy(scope, send, state)
            return
        self.requests[address] = held + 1
        try:
            with admission:
                await self.app(scope, receive, send)
        finally:
            _less(self.requests, address)

    async def _busy(self, scope: Scope, send: Send, state: dict[str, Any]) -> None:
        error = ApiError(
            429,
            "rate_limited",
            f"more than {self.per_client} requests at once from this client without a key; "
            "wait for their answers",
            retry_after=1.0,
        )
        state["error"] = error
        await send_rendered(send, rendered_error(error, _wants_msgpack(scope)))

    def _log(
        self,
        scope: Scope,
        request_id: str,
        status: int,
        elapsed: float,
        error: object,
        failure: BaseException | None,
    ) -> None:
        fields: dict[str, Any] = {
            "request_id": request_id,
            "method": scope["method"],
            "path": scope["path"][:LOGGED_PATH_CHARS],
            "status": status,
            "duration_ms": round(elapsed * 1000, 3),
        }
        if isinstance(error, ApiError):
            fields.update(code=error.code, error=error.message, field=error.field)
        if status == 503:
            # Back-pressure or cluster trouble: expected under load, and a storm of them must not
            # cost a traceback each. One line names the cause; the metrics count them.
            if failure is not None:
                fields["cause"] = f"{type(failure).__name__}: {str(failure)[:300]}"
            if self.access_log:
                log.warning("request refused", extra={"fields": fields})
            else:
                _unavailable.refused(fields)
        elif failure is not None or status >= 500:
            log.error("request failed", exc_info=failure, extra={"fields": fields})
        elif status >= 400:
            if self.access_log:
                log.info("request refused", extra={"fields": fields})
            else:
                _client_errors.refused(fields)
        else:
            log.info("request", extra={"fields": fields})


class RefusedLines:
    """The log lines of refused requests of one kind (4xx: the client's doing; 503: back-pressure
    or cluster trouble), a line a minute at most at ``level``. Anybody may send tens of thousands
    of requests a second that are refused, and as many during an outage: a line each (some 300
    bytes) filled a disk and drowned every other line. The first refusal is logged at once; each
    later one that comes a minute or more after the last line logged is logged with ``refused``
    (the refusals since that line, this one included) and ``codes`` (them by error code, a bounded
    set: the error table's). Each other refusal is a ``debug`` line (SHARDLB_LOG_LEVEL=debug shows
    them all); shardlb_http_responses_total counts every one."""

    def __init__(
        self, level: int, every_s: float = REFUSALS_LOG_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.level = level
        self.every_s = every_s
        self.clock = clock
        self.logged_at: float | None = None
        self.codes: dict[str, int] = {}

    def refused(self, fields: dict[str, Any]) -> None:
        code = str(fields.get("code") or fields["status"])
        self.codes[code] = self.codes.get(code, 0) + 1
        now = self.clock()
        if self.logged_at is not None and now - self.logged_at < self.every_s:
            log.debug("request refused", extra={"fields": fields})
            return
        codes, self.codes, self.logged_at = self.codes, {}, now
        line = {**fields, "refused": sum(codes.values()), "codes": codes}
        log.log(self.level, "request refused", extra={"fields": line})


_client_errors = RefusedLines(logging.INFO)
_unavailable = RefusedLines(logging.WARNING)


def _less(counts: dict[str, int], key: str) -> None:
    """One less for ``key``; gone at zero (the dicts hold only clients with something in progress)."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


def _forwarded_client(scope: Scope, proxies: tuple[Network, ...]) -> None:
    client = scope.get("client")
    if not client:
        return
    forwarded = b",".join(value for name, value in scope["headers"] if name == b"x-forwarded-for")
    address = client_address(client[0], forwarded.decode("latin-1"), proxies)
    if address != client[0]:
        scope["client"] = (address, 0)


def _read_ahead_bytes(scope: Scope) -> int:
    service = getattr(getattr(scope.get("app"), "state", None), "service", None)
    settings = getattr(service, "settings", None)
    return READ_AHEAD_BYTES if settings is None else int(settings.max_read_body_bytes)


# Whom the body slots are counted for: an IPv4 address, or an IPv6 address's /64 (one subscriber's
# network holds more addresses than a worker has slots), as the read budgets count clients.
body_client = client_network


def _head(headers: list[tuple[bytes, bytes]]) -> tuple[bytes | None, bool]:
    """The request's (first) Authorization, and whether it has a body. Every route checks a key
    before it reads a body (a wrong one is 401 at once), so only a holder of a key of the write
    scope, whom the operator trusts, can make a slot wait for a body; such requests skip the
    per-client counts. A read key is the least of the keys (with SHARDLB_READS_REQUIRE_KEY it goes
    to whoever may read): its body is counted as one without a key is (until 2026-12-05 any key
    skipped the counts, and a read key's stalled players:query bodies held every slot)."""
    authorization = None
    body = False
    for name, value in headers:
        if name == b"authorization":
            if authorization is None:
                authorization = value
        elif (name == b"content-length" and value.strip(b" \t0")) or name == b"transfer-encoding":
            body = True
    return authorization, body


def _may_write(scope: Scope, authorization: bytes) -> bool:
    """Whether the request's Authorization presents a key of the write scope or above (an app
    without a service, as in some tests, trusts every key, as the middleware did before)."""
    service = getattr(getattr(scope.get("app"), "state", None), "service", None)
    keys = getattr(service, "keys", None)
    return keys is None or bool(keys.may_write(authorization.decode("latin-1")))


async def _read_ahead(receive: Receive, limit: int) -> Receive:
    """Read a body's messages until it ends, passes ``limit`` bytes, or the client is gone; the
    ``receive`` returned hands them to the app in order, then reads on."""
    messages: deque[Message] = deque()
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        size += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False) or size > limit:
            break

    async def replay() -> Message:
        return messages.popleft() if messages else await receive()

    return replay


def _from_another_site(scope: Scope) -> bool:
    """Whether a browser sent the request from a page of another site: its ``Sec-Fetch-Site``
    says so (same-site too: another port of localhost is the same site), or its ``Origin`` is not
    the ``Host`` it was sent to (``null``, from a sandboxed frame or a file, included)."""
    site = origin = host = None
    for name, value in scope["headers"]:
        if name == b"sec-fetch-site":
            site = value
        elif name == b"origin":
            origin = value
        elif name == b"host":
            host = value
    if site is not None and site.strip().lower() in (b"cross-site", b"same-site"):
        return True
    if origin is None:
        return False
    _, sep, authority = origin.strip().partition(b"://")
    return not sep or authority.lower() != (host or b"").strip().lower()


def _wants_msgpack(scope: Scope) -> bool:
    accept = next((value for name, value in scope["headers"] if name == b"accept"), None)
    return accept is not None and wants_msgpack(accept.decode("latin-1"))


def _request_id(scope: Scope) -> tuple[str, bool]:
    """The request's id, and whether the client sent an X-Request-Id that was not sane (replaced)."""
    replaced = False
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            if _REQUEST_ID.fullmatch(value):
                return str(value.decode()), False
            replaced = True
    return new_request_id(), replaced


def retry_key(request: Request) -> str | None:
    """The request id of a call whose retry it names (a removal, a ban, a lift: router/moderation.py,
    where a retry with the same id is the same call). An X-Request-Id that is not sane is 400
    ``invalid_request_id`` there, before anything is written: replaced by a random one, as for any
    other call's tracing, it left the client without the retry key it thought it sent, and a ban
    lifted and then retried with it banned again (until 2026-12-06). So are two X-Request-Id headers
    that differ: the first sane one would be the key, and a proxy may add one or change their order
    between a try and its retry (the same id sent twice is one key). Sent without one, the call gets
    the id the router made up, new each try. Counted here, on these three calls alone: every other
    request's id stays the middleware's one pass over the headers (``_request_id``)."""
    sent = {value for name, value in request.scope["headers"] if name == b"x-request-id"}
    if len(sent) > 1:
        raise ApiError(
            400,
            "invalid_request_id",
            f"X-Request-Id is this call's retry key: send one, not {len(sent)} different ones",
        )
    if getattr(request.state, REPLACED, False):
        raise ApiError(
            400,
            "invalid_request_id",
            "X-Request-Id is this call's retry key: it must be 1-128 characters of A-Z a-z 0-9 . _ : - "
            "(or left out, and each try is a call of its own)",
        )
    request_id = getattr(request.state, "request_id", None)
    return None if request_id is None else str(request_id)


def new_request_id() -> str:
    # 64 random bits per process and a counter: unique across workers and restarts, with no
    # system call per request.
    return f"{_prefix}{next(_sequence):016x}"


def log_refused(error: ApiError, request_id: str, method: str, path: str, each: bool = False) -> None:
    """A request refused by the HTTP protocol before any app ran (router/http.py: 408, 431), logged
    and counted as the middleware logs and counts a refusal: ``each`` (SHARDLB_ACCESS_LOG) a line
    each, else a line a minute (``RefusedLines``)."""
    _counter("unmatched", error.status)(1)
    fields = {
        "request_id": request_id,
        "method": method,
        "path": path[:LOGGED_PATH_CHARS],
        "status": error.status,
        "code": error.code,
        "error": error.message,
        "field": error.field,
    }
    if each:
        log.info("request refused", extra={"fields": fields})
    else:
        _client_errors.refused(fields)


def _new_prefix() -> None:
    global _prefix
    _prefix = os.urandom(8).hex()


_prefix = ""
_new_prefix()
os.register_at_fork(after_in_child=_new_prefix)  # a forked worker must not repeat its parent's ids
_sequence = itertools.count()


@functools.lru_cache(maxsize=1024)
def _timer(method: str, route: str) -> Callable[[float], None]:
    """The labelled histogram child's observe (looking labels up costs more than observing)."""
    return metrics.observer(metrics.REQUEST_SECONDS.labels(method, route))


@functools.lru_cache(maxsize=1024)
def _counter(route: str, status: int) -> Callable[[float], None]:
    """The labelled counter child's inc."""
    return metrics.counter(metrics.RESPONSES.labels(route, str(status)))
