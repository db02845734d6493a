"""Helpers of the client tests (this module holds no tests): the real router served over TCP by
uvicorn in the test's own event loop, behind ``Faults``, an ASGI wrapper that fails score writes on
purpose the two ways a network and an overloaded router do."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shardlb.board import Score
from shardlb.client import Entry, MatchResult
from shardlb.config import BoardConfig
from tests.ports import server_port, server_socket
from tests.reference import ReferenceBoard
from tests.router_support import running


def free_port() -> int:
    """A free TCP port of this process's own, below the ephemeral range (tests/ports.py)."""
    return server_port()


class DroppedAnswer(Exception):
    """Raised by ``Faults`` after the router applied a write: uvicorn then closes the connection."""


class Faults:
    """Passes everything to the router, except that each score write is, at random, ``refuse``:
    answered 503 ``overloaded`` before the router sees it (nothing applied), or ``drop``: applied
    by the router and its answer cut off after the status line (the client cannot tell whether it
    was applied). ``seen`` counts the requests per X-Request-Id (the client's attempts of a call)."""

    def __init__(self, app: ASGIApp, seed: int = 0) -> None:
        self.app = app
        self.rng = random.Random(seed)
        self.refuse = 0.0
        self.drop = 0.0
        self.retry_after = "0"
        self.counts: Counter[str] = Counter()
        self.seen: Counter[str] = Counter()

    def calm(self) -> None:
        self.refuse = self.drop = 0.0
        self.retry_after = "0"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        self.seen[headers.get(b"x-request-id", b"").decode()] += 1
        if not (scope["method"] == "POST" and scope["path"].endswith("/scores")):
            await self.app(scope, receive, send)
            return
        self.counts["writes"] += 1
        roll = self.rng.random()
        if roll < self.refuse:
            self.counts["refused"] += 1
            body = orjson.dumps({"error": {"code": "overloaded", "message": "test storm", "field": None}})
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"retry-after", self.retry_after.encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        if roll < self.refuse + self.drop:
            self.counts["dropped"] += 1
            answer: list[Message] = []

            async def keep(message: Message) -> None:
                answer.append(message)

            await self.app(scope, receive, keep)
            await send({**answer[0], "type": "http.response.start"})
            raise DroppedAnswer("the test cuts this answer off after the router applied the write")
        await self.app(scope, receive, send)


@dataclass
class Served:
    url: str
    faults: Faults


@asynccontextmanager
async def served_router(cluster_url: str, **settings: Any) -> AsyncIterator[Served]:
    """The router app (lifespan entered; ``settings`` override the test settings) behind ``Faults``,
    served by uvicorn on a free port."""
    async with running(cluster_url, **settings) as (app, _):
        faults = Faults(app)
        sock = server_socket()  # bound here and held: no other process takes the port before uvicorn
        port = sock.getsockname()[1]
        config = uvicorn.Config(faults, lifespan="off", log_level="critical", proxy_headers=False)
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if serving.done():
                serving.result()
            await asyncio.sleep(0.01)
        try:
            yield Served(f"http://127.0.0.1:{port}", faults)
        finally:
            server.should_exit = True
            await serving
            sock.close()  # uvicorn closed it once it served; not if its start failed


def submit(reference: ReferenceBoard, results: list[MatchResult]) -> list[tuple[str, int]]:
    """Apply these results (each with an integer ``achieved_at``) to the reference, in order; its
    (status, points) per result."""
    scores = []
    for r in results:
        assert isinstance(r.achieved_at, int)
        scores.append(Score(r.player_id, r.points, r.match_id, r.achieved_at, r.region))
    return reference.submit(scores, now_ms=0)


def reference_for(config: BoardConfig, results: list[MatchResult]) -> ReferenceBoard:
    """The reference board after these results. For ``best`` and ``incr`` boards the order in which
    results arrive changes no final value, so it stands for results posted concurrently too."""
    reference = ReferenceBoard(config)
    submit(reference, results)
    return reference


def expected_entries(reference: ReferenceBoard, period: str = "total") -> list[tuple[int, str, int, int]]:
    """(rank, player, points, achieved ms) of every row, best first."""
    codec = reference.codec
    return [
        (rank, player, points, codec.epoch_ms + units * codec.unit_ms)
        for rank, (_, player, points, units) in enumerate(reference.order(period), start=1)
    ]


def rows(entries: list[Entry]) -> list[tuple[int, str, int, int]]:
    return [(e.rank, e.player_id, e.points, round(e.achieved_at.timestamp() * 1000)) for e in entries]
