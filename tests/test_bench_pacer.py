"""bench/pacer.py: the light paced client posts the workload's matches, counts what it should and
tells failures apart, against a small HTTP server of the test's own."""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import replace

import orjson
import pytest

from bench import pacer
from bench.workload import Workload

W = Workload(board="pace-t", players=1000)


class Server:
    """Answers every POST with ``status`` and a small JSON body; keeps each request's bytes."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.bodies: list[bytes] = []
        self.heads: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                self.heads.append(head)
                self.bodies.append(await reader.readexactly(length))
                body = b'{"results": []}'
                writer.write(
                    f"HTTP/1.1 {self.status} X\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body
                )
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@pytest.fixture
async def serving() -> AsyncIterator[tuple[Server, Server, int, int]]:
    ok, refusing = Server(200), Server(503)
    servers = [await asyncio.start_server(s.handle, "127.0.0.1", 0) for s in (ok, refusing)]
    ports = [srv.sockets[0].getsockname()[1] for srv in servers]
    yield ok, refusing, ports[0], ports[1]
    for srv in servers:
        srv.close()


def _args(
    port: int,
    users: int = 3,
    rps: float = 20.0,
    seconds: float = 1.2,
    settle: float = 0.4,
    matches: int = 1,
) -> argparse.Namespace:
    return argparse.Namespace(
        url=f"http://127.0.0.1:{port}",
        users=users,
        rps=rps,
        seconds=seconds,
        settle=settle,
        key="k",
        seed="t",
        matches=matches,
    )


async def test_paced_users_post_the_workloads_matches_and_count_after_the_settle_time(
    serving: tuple[Server, Server, int, int],
) -> None:
    ok, _, port, _ = serving
    got = await pacer.run(_args(port), W)
    # Three users at 20 requests a second for 1.2 s: at most 3 x 24 requests (plus the one each
    # user may start at the end), of which those started in the first 0.4 s are not counted.
    assert 0 < got["requests"] <= len(ok.bodies) <= 3 * 25
    assert got["requests"] < len(ok.bodies)
    assert got["failures"] == 0 and got["p50_ms"] is not None and got["p50_ms"] <= got["p99_ms"]
    assert got["offered_requests_per_s"] == 60.0 and got["client_cpu_s"] >= 0
    scores = orjson.loads(ok.bodies[0])["scores"]
    assert len(scores) == W.players_per_match and len({s["match_id"] for s in scores}) == 1
    assert all(h.startswith(b"POST /v1/boards/pace-t/scores HTTP/1.1\r\n") for h in ok.heads)
    assert all(b"Authorization: Bearer k\r\n" in h for h in ok.heads)
    # A replay is a whole match too, counted apart: it writes nothing new.
    assert got["scores"] + got["replayed_scores"] == got["requests"] * W.players_per_match


async def test_a_request_may_carry_several_matches_and_the_scores_are_counted(
    serving: tuple[Server, Server, int, int],
) -> None:
    """--matches N: each POST carries N whole matches (a game server batching its results), and
    ``scores`` counts the fresh player-scores of the counted requests and ``replayed_scores`` those
    of their exact retries, which write nothing new (as the locustfile's ``replayed-scores``)."""
    ok, _, port, _ = serving
    got = await pacer.run(_args(port, matches=4), replace(W, retry_share=0.3))
    for body in ok.bodies:
        scores = orjson.loads(body)["scores"]
        by_match: dict[str, int] = {}
        for s in scores:
            by_match[s["match_id"]] = by_match.get(s["match_id"], 0) + 1
        assert len(by_match) == 4 and set(by_match.values()) == {W.players_per_match}
    assert got["requests"] > 0 and got["replayed_scores"] > 0 and got["scores"] > 0
    assert got["scores"] + got["replayed_scores"] == got["requests"] * 4 * W.players_per_match
    assert got["replayed_scores"] % (4 * W.players_per_match) == 0


async def test_refused_requests_are_failures_not_latencies(serving: tuple[Server, Server, int, int]) -> None:
    _, refusing, _, port = serving
    got = await pacer.run(_args(port, users=2), W)
    assert got["requests"] == 0 and got["p99_ms"] is None
    assert got["failures"] > 0 and got["failure_samples"][0] == "HTTP 503"
    assert len(refusing.bodies) > got["failures"]  # those before the settle time are not counted


async def test_a_closed_port_is_counted_as_failures(unused_tcp_port: int) -> None:
    got = await pacer.run(_args(unused_tcp_port, users=1, rps=10.0, seconds=0.5, settle=0.0), W)
    assert got["requests"] == 0 and got["failures"] > 0
    assert "ConnectionRefusedError" in got["failure_samples"][0]


def test_retries_replay_a_recent_post_byte_for_byte() -> None:
    always = pacer.MatchBodies(replace(W, retry_share=1.0), random.Random(1))
    body, n, replay = always()  # nothing to replay yet: a new match
    assert not replay and n == W.players_per_match
    always.accepted(body, n)
    assert [always() for _ in range(5)] == [(body, n, True)] * 5
    never = pacer.MatchBodies(replace(W, retry_share=0.0), random.Random(1))
    posts = [never() for _ in range(20)]
    assert len({b for b, _, _ in posts}) == 20 and not any(r for _, _, r in posts)
    batched = pacer.MatchBodies(replace(W, retry_share=1.0), random.Random(1), matches=3)
    body, n, _ = batched()
    batched.accepted(body, n)
    assert n == 3 * W.players_per_match == len(orjson.loads(body)["scores"])
    assert [batched() for _ in range(3)] == [(body, n, True)] * 3


def test_a_post_the_router_refused_is_never_replayed() -> None:
    """A refused post (429, 503, a lost connection) wrote nothing: sent again it would write its
    scores for the first time, counted as a replay's. Until 2026-12-05 every post was kept for
    replays before it was sent, as the locustfile's were."""
    always = pacer.MatchBodies(replace(W, retry_share=1.0), random.Random(1))
    refused = always()
    fresh = always()  # the first was never accepted: nothing to replay yet
    assert not fresh[2] and fresh[0] != refused[0]
    always.accepted(fresh[0], fresh[1])
    assert always() == (fresh[0], fresh[1], True)


def test_the_request_carries_its_body_in_the_same_write() -> None:
    raw = pacer.request_bytes("h:1", "/p", "", b'{"a":1}')
    assert raw == (
        b"POST /p HTTP/1.1\r\nHost: h:1\r\nContent-Type: application/json\r\n"
        b'Accept: application/json\r\nContent-Length: 7\r\n\r\n{"a":1}'
    )


async def test_runs_without_a_seed_post_matches_of_their_own(
    serving: tuple[Server, Server, int, int],
) -> None:
    """Every bench phase starts the pacer without --seed: each run must post new matches. With one
    fixed sequence, a phase replayed the matches of the phase before it, and a repeated match is a
    duplicate that costs the store a check instead of a write (the store CPU of the router's own
    maximum and the latency of the paced steps were measured on such writes). --seed repeats one."""
    ok, _, port, _ = serving
    matches = []
    for seed in (None, None, "s", "s"):
        ok.bodies.clear()
        args = _args(port, users=1, rps=10.0, seconds=0.3, settle=0.0)
        args.seed = seed
        await pacer.run(args, replace(W, retry_share=0.0))
        matches.append({s["match_id"] for body in ok.bodies for s in orjson.loads(body)["scores"]})
    assert all(matches) and not matches[0] & matches[1]
    assert matches[2] & matches[3]
    parsed = pacer.parser().parse_args(["--url", "http://h:1", "--users", "1"])
    assert parsed.seed is None


def test_p99_slots_say_whether_the_slowest_requests_came_together() -> None:
    """The requests at or above the p99 (3 of 200) all started in one 100 ms slot: one stall set
    the p99; spread over the window, each has a slot of its own."""
    starts = [i * 0.01 for i in range(200)]  # 2 s, 100 requests a second
    slow = (125, 126, 127)
    together = pacer.Tally(latencies=[50.0 if i in slow else 5.0 for i in range(200)], starts=starts)
    assert together.p99_slots() == {"slots": 1, "busiest": 3, "requests": 3}
    assert together.summary(2.0)["p99_slots"] == {"slots": 1, "busiest": 3, "requests": 3}
    apart = pacer.Tally(latencies=[50.0 if i in (15, 105, 185) else 5.0 for i in range(200)], starts=starts)
    assert apart.p99_slots() == {"slots": 3, "busiest": 1, "requests": 3}
    assert pacer.Tally().p99_slots() is None


async def test_a_runs_counted_requests_each_have_their_start(
    serving: tuple[Server, Server, int, int],
) -> None:
    _, _, port, _ = serving
    got = await pacer.run(_args(port), W)
    slots = got["p99_slots"]
    assert slots is not None and 1 <= slots["slots"] <= slots["requests"] and slots["busiest"] >= 1
