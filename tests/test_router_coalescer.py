"""The write coalescer: many concurrent writers against a reference model, back-pressure, drain."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from router.app import create_app
from router.coalescer import Coalescer, Drained, primary_of
from router.errors import ApiError
from shardlb import keys, times
from shardlb.board import Prepared, Result, Score
from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.errors import Overloaded
from shardlb.outage import described
from shardlb.store import BoardStore
from tests.ports import node_ports
from tests.reference import ReferenceBoard
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running, service_of, settings_for
from tests.test_router_logs import kept

pytestmark = pytest.mark.cluster

T0 = 1_790_000_000_000


def batch_totals() -> tuple[float, float]:
    """(script calls, scores) the coalescer has sent so far in this process."""
    calls = REGISTRY.get_sample_value("shardlb_coalescer_batch_size_count") or 0.0
    scores = REGISTRY.get_sample_value("shardlb_coalescer_batch_size_sum") or 0.0
    return calls, scores


def scores_by_status() -> dict[str, float]:
    """The scores the coalescer has counted applied so far in this process, by status."""
    return {
        sample.labels["status"]: sample.value
        for family in REGISTRY.collect()
        if family.name == "shardlb_scores_applied"
        for sample in family.samples
        if sample.name == "shardlb_scores_applied_total"
    }


def as_body(scores: list[Score]) -> dict[str, Any]:
    return {
        "scores": [
            {
                "player_id": s.player_id,
                "points": s.points,
                "match_id": s.match_id,
                "achieved_at": s.achieved_ms,
            }
            for s in scores
        ]
    }


BAND = {"strategy": "band", "shards": 4, "bands": [0, 40, 120, 400]}


@pytest.mark.parametrize(
    ("mode", "inflight", "sharding"),
    [
        *((m, i, {"strategy": "hash", "shards": 8}) for i in (1, 3) for m in ("incr", "best", "set")),
        *((m, 1, BAND) for m in ("incr", "best", "set")),
    ],
)
async def test_concurrent_writers_match_the_reference(
    cluster: LocalCluster, store: BoardStore, mode: str, inflight: int, sharding: dict[str, Any]
) -> None:
    """Writers own disjoint players, so each writer's statuses are those of applying its requests in
    its own order, whatever the interleaving; the final board is the reference's. So too with up to
    three script calls in flight per shard (SHARDLB_COALESCE_INFLIGHT), and on a band board, whose
    writes also move players between band shards: every page read right after the writes is the
    reference's, and no move is left pending."""
    rng = random.Random(f"coalescer-{mode}")
    settings = {"mode": mode, "sharding": sharding}
    name = board_name()
    reference = ReferenceBoard(BoardConfig.from_dict(name, settings))
    writers, requests_each = 16, 10
    plans: list[list[tuple[list[Score], list[tuple[str, int]]]]] = []
    for w in range(writers):
        plan = []
        for _ in range(requests_each):
            scores = [
                Score(
                    f"w{w}-p{rng.randrange(8)}",
                    rng.randrange(60),
                    f"m{rng.randrange(25)}",
                    T0 + rng.randrange(0, 3_600_000, 1000),
                )
                for _ in range(rng.randrange(1, 40))
            ]
            plan.append((scores, reference.submit(scores, T0)))
        plans.append(plan)

    async with running(cluster.url, coalesce_delay_ms=2.0, coalesce_inflight=inflight) as (app, client):
        assert (await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)).status_code == 201
        calls_before, scores_before = batch_totals()
        counted_before = scores_by_status()

        async def writer(plan: list[tuple[list[Score], list[tuple[str, int]]]]) -> None:
            for scores, expected in plan:
                r = await client.post(f"/v1/boards/{name}/scores", json=as_body(scores), headers=AS_WRITER)
                assert r.status_code == 200, r.text
                got = [(x["status"], x["points"]) for x in r.json()["results"]]
                assert got == expected
                assert [x["player_id"] for x in r.json()["results"]] == [s.player_id for s in scores]

        await asyncio.gather(*(writer(plan) for plan in plans))
        calls, sent = (a - b for a, b in zip(batch_totals(), (calls_before, scores_before), strict=True))
        total = sum(len(scores) for plan in plans for scores, _ in plan)
        assert sent == total
        assert sent / calls > 2, "concurrent requests should share script calls"
        # Each batch's scores are counted by status (shardlb_scores_applied_total), as answered.
        counted = {k: v - counted_before.get(k, 0.0) for k, v in scores_by_status().items()}
        statuses = [status for plan in plans for _, expected in plan for status, _ in expected]
        assert {k: v for k, v in counted.items() if v} == {s: statuses.count(s) for s in set(statuses)}
        assert service_of(app).coalescer.inflight == inflight

        top = (await client.get(f"/v1/boards/{name}/entries", params={"limit": 1000})).json()["entries"]
        codec = reference.codec
        assert [(e["rank"], e["player_id"], e["points"], e["achieved_at"]) for e in top] == [
            (i + 1, player, points, times.format_ms(codec.units_to_ms(units)))
            for i, (_, player, points, units) in enumerate(reference.order())
        ]
        if sharding["strategy"] == "band":
            board = await store.get(name)
            homes = [keys.pending_key(board.prefixes[h]) for h in range(board.config.sharding.shards)]
            assert not any([await store.client.hlen(k) for k in homes]), "moves left pending"
            assert await board.repair() == 0
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_full_queue_answers_503_at_once(cluster: LocalCluster) -> None:
    # A long tick keeps accepted scores queued, so the queue is visibly full when the third arrives.
    async with running(cluster.url, queue_limit=1000, coalesce_delay_ms=1000, coalesce_max_batch=5000) as (
        _,
        client,
    ):
        name = board_name()
        await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)

        def body(request: int) -> dict[str, Any]:
            return {
                "scores": [{"player_id": f"r{request}-{i}", "points": i, "match_id": "m"} for i in range(400)]
            }

        async def send(request: int) -> tuple[int, httpx.Response]:
            return request, await client.post(
                f"/v1/boards/{name}/scores", json=body(request), headers=AS_WRITER
            )

        pending = {asyncio.create_task(send(i)) for i in range(3)}
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        (first,) = done
        refused, response = first.result()
        assert response.status_code == 503 and response.json()["error"]["code"] == "overloaded"
        assert int(response.headers["retry-after"]) >= 1
        assert len(pending) == 2, "the refusal must not wait for the queued scores to be applied"
        accepted = [await task for task in pending]
        assert all(r.status_code == 200 for _, r in accepted)

        entries = (await client.get(f"/v1/boards/{name}/entries", params={"limit": 1000})).json()["entries"]
        on_board = {e["player_id"]: e["points"] for e in entries}
        assert len(on_board) == 800
        for request, _ in accepted:
            assert all(on_board[f"r{request}-{i}"] == i for i in range(400))
        assert not any(p.startswith(f"r{refused}-") for p in on_board)
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_saturated_writers_lose_nothing_acknowledged(cluster: LocalCluster, store: BoardStore) -> None:
    async with running(cluster.url, queue_limit=1000, coalesce_delay_ms=20, node_concurrency=1) as (
        _,
        client,
    ):
        name = board_name()
        await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)

        async def send(request: int) -> tuple[int, httpx.Response]:
            scores = [
                {"player_id": f"r{request}-{i}", "points": request, "match_id": "m"} for i in range(150)
            ]
            return request, await client.post(
                f"/v1/boards/{name}/scores", json={"scores": scores}, headers=AS_WRITER
            )

        outcomes = await asyncio.gather(*(send(i) for i in range(40)))
        assert {r.status_code for _, r in outcomes} == {200, 503}
        assert all(int(r.headers["retry-after"]) >= 1 for _, r in outcomes if r.status_code == 503)
    board = await store.get(name)
    acknowledged = {f"r{q}-{i}": q for q, r in outcomes if r.status_code == 200 for i in range(150)}
    found = await board.scores([f"r{q}-{i}" for q in range(40) for i in range(150)])
    assert {player: board.codec.decode(value)[0] for player, value in found.items()} == acknowledged
    assert await board.size() == len(acknowledged)
    await store.delete(name)


async def test_shutdown_applies_what_was_accepted(cluster: LocalCluster, store: BoardStore) -> None:
    app = create_app(settings_for(cluster.url, coalesce_delay_ms=1000, drain_seconds=5))
    lifespan = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    name = board_name()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://router.test"
    ) as client:
        await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)

        async def send(request: int) -> httpx.Response:
            scores = [{"player_id": f"r{request}-{i}", "points": 7, "match_id": "m"} for i in range(50)]
            return await client.post(f"/v1/boards/{name}/scores", json={"scores": scores}, headers=AS_WRITER)

        tasks = [asyncio.create_task(send(i)) for i in range(4)]
        while service_of(app).coalescer.depth < 200:  # all four accepted, waiting for a 1 s tick
            await asyncio.sleep(0.005)
        assert not any(t.done() for t in tasks)
        await lifespan.__aexit__(None, None, None)  # what uvicorn runs on SIGTERM
        responses = await asyncio.gather(*tasks)
        assert [r.status_code for r in responses] == [200] * 4
        late = await send(9)
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert (await client.get("/readyz")).status_code == 503
    board = await store.get(name)
    assert await board.size() == 200
    await store.delete(name)


async def test_a_pinned_retry_refused_on_its_second_call_fails_its_request_only(store: BoardStore) -> None:
    """Two requests share one shard call: a new result, and a retry without achieved_at whose pin
    lies in another day (answered `p`, sent again with its time). The journal takes the first call
    and is then at its bound, so the second call is refused: the first request is answered with
    what was applied, the retry's request alone gets 503, and its retry is safe."""
    config = BoardConfig.from_dict(board_name(), {"mode": "incr", "periods": ["total", "daily"]})
    board, _ = await store.create(config)
    home = board.layout.home("b")
    a = next(f"a{i}" for i in range(1000) if board.layout.home(f"a{i}") == home)
    yesterday = times.now_ms() // 86_400_000 * 86_400_000 - 60_000  # in the dedup window, another day
    try:
        first = board.prepare([Score("b", 5, "mb")], now_ms=yesterday)
        await board.apply_shard(home, first, now_ms=yesterday)
        await board.client.delete(keys.journal_key(board.prefixes[home]))  # archived since
        board.journal_max_results = 1  # room for the first call's one result
        coalescer = Coalescer(delay_s=0.01, node_of=lambda b, s: "n")
        new, retry = await asyncio.gather(
            coalescer.submit(board, board.prepare([Score(a, 7, "ma")])),
            coalescer.submit(board, board.prepare([Score("b", 5, "mb")])),
            return_exceptions=True,
        )
        assert new == [Result(a, "ma", "improved", 7)]
        assert isinstance(retry, Overloaded)
        board.journal_max_results = 10**6
        assert await coalescer.submit(board, board.prepare([Score(a, 7, "ma")])) == [
            Result(a, "ma", "duplicate", 7)
        ]
        assert await coalescer.submit(board, board.prepare([Score("b", 5, "mb")])) == [
            Result("b", "mb", "duplicate", 5)
        ]
        await coalescer.close(5)
    finally:
        await store.delete(config.id)


class _Unanswered:
    """A board whose shard calls never come back (a cluster that does not answer within the drain):
    the coalescer's own bookkeeping at a drain that times out, no ranking involved. ``sent`` holds
    the players of every call it was given: as far as the coalescer can know, those were applied."""

    def __init__(self) -> None:
        self.config = BoardConfig.from_dict("unanswered", {})
        self.sent: list[str] = []

    async def apply_shard(self, shard: int, batch: Any, pipeline: Any = None) -> Any:
        self.sent += [p.player_id for p in batch]
        await asyncio.sleep(3600)


async def until(done: Callable[[], bool]) -> None:
    """Once ``done()``: the coalescer's tasks have got that far (a loaded machine may take a while)."""
    deadline = asyncio.get_running_loop().time() + 10
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "the coalescer never got there"
        await asyncio.sleep(0.001)


async def test_a_drain_that_times_out_answers_every_request_even_those_still_queued() -> None:
    def prepared(player: str) -> Prepared:
        return Prepared(player, "m", 1, 0, 0, 0, ("total",))

    board: Any = _Unanswered()
    coalescer = Coalescer(delay_s=0.001, max_batch=2, node_of=lambda b, s: "n")
    sent = asyncio.create_task(coalescer.submit(board, [prepared("a1"), prepared("a2")]))
    await until(lambda: board.sent == ["a1", "a2"])  # its call is in flight
    queued = asyncio.create_task(coalescer.submit(board, [prepared("b1")]))  # behind it (one call at a time)
    await until(lambda: coalescer.depth == 3)
    assert await coalescer.close(0.2) == Drained(not_applied=1, in_doubt=2)
    done, _ = await asyncio.wait({sent, queued}, timeout=2)
    assert done == {sent, queued}
    for task in (sent, queued):
        error = task.exception()
        assert isinstance(error, ApiError) and (error.status, error.code) == (503, "shutting_down")
    assert coalescer.depth == 0


async def test_a_timed_out_drain_counts_as_not_applied_only_what_was_never_sent() -> None:
    """``scores_not_applied`` counted every score still unanswered at the drain's timeout,
    those of calls sent to the cluster (which may well have applied them) included. Now only the
    scores never sent (queued, or waiting for their primary's permit) are not applied; the sent
    ones whose answer never came are ``in_doubt``."""

    def prepared(player: str, shard: int) -> Prepared:
        return Prepared(player, "m", 1, 0, 0, shard, ("total",))

    board: Any = _Unanswered()
    coalescer = Coalescer(delay_s=0.001, max_batch=2, node_concurrency=1, wait_s=60, node_of=lambda b, s: "n")
    requests = [
        asyncio.create_task(coalescer.submit(board, [prepared("a1", 0), prepared("a2", 0)])),  # sent
        asyncio.create_task(coalescer.submit(board, [prepared("b1", 1)])),  # waits for the permit
    ]
    await until(lambda: board.sent == ["a1", "a2"] and coalescer.depth == 3)
    requests.append(asyncio.create_task(coalescer.submit(board, [prepared("a3", 0)])))  # queued behind a1, a2
    await until(lambda: coalescer.depth == 4)
    with kept("shardlb.router") as log:
        drained = await coalescer.close(0.2)
    assert board.sent == ["a1", "a2"]
    assert drained == Drained(not_applied=2, in_doubt=2)
    [(_, fields)] = log.lines(logging.ERROR)
    assert (fields["scores_not_applied"], fields["scores_in_doubt"]) == (2, 2)
    await asyncio.wait(requests, timeout=2)
    assert all(isinstance(r.exception(), ApiError) for r in requests) and coalescer.depth == 0


async def test_a_primary_out_of_reach_is_a_few_warnings_per_primary_not_one_per_batch(tmp_path: Path) -> None:
    """Every failed shard call logged "shard write failed": during an outage, one line per batch on
    top of the 503 line of each response (router/README.md), tens of thousands a second under load.
    Now each primary's failures are logged as an outage (shardlb/outage.py): the first at once, with
    its error, then once a minute at most with the count, and "shard writes work again" at its first
    call that works. Two primaries down one after the other each have their warning."""
    # 2 masters, no replica: one master alone cannot mark the other failed, so the cluster stays up
    # for the live one's slots; durable, so `up` starts the killed nodes again from their files.
    port = node_ports(2)
    local = LocalCluster(2, 0, port, tmp_path / "c", durable=True)
    local.up()
    client = connect(local.url)
    try:
        # Each write on disk before its reply: with `appendfsync everysec` Redis may hold a write back
        # up to 2 s while an fsync is slow (a loaded machine), and a node killed then comes back
        # without the shards' sentinels: its writes refused (503 board_rebuilding), as they should be.
        await client.execute_command("CONFIG SET", "appendfsync", "always", target_nodes=client.PRIMARIES)
        scripts = Scripts.register(client)
        await scripts.load(client)
        store = BoardStore(client, scripts)
        config = BoardConfig.from_dict("outage", {"sharding": {"strategy": "hash", "shards": 4}})
        board, _ = await store.create(config)
        pids = {f"{local.host}:{n.port}": n.pid for n in local.status().nodes}
        first, second = sorted({primary_of(board, shard) for shard in range(4)})
        per_node = 6
        players: dict[str, list[str]] = {first: [], second: []}
        for i in range(1000):
            mine = players[primary_of(board, board.layout.home(f"p{i}"))]
            if len(mine) < per_node:
                mine.append(f"p{i}")
        # One score a call, all sent at once: each request is a batch of its own.
        coalescer = Coalescer(delay_s=0.001, max_batch=1, inflight=per_node)

        async def write(node: str, points: int) -> list[Any]:
            return await asyncio.gather(
                *(coalescer.submit(board, board.prepare([Score(p, points, "m")])) for p in players[node]),
                return_exceptions=True,
            )

        with kept("shardlb.router") as log:
            failures: dict[str, list[Any]] = {}
            for node in (first, second):
                pid = pids[node]
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                failures[node] = await write(node, 2)
                assert all(isinstance(r, Exception) for r in failures[node]), failures[node]
            local.up()
            for node in (first, second):
                assert [r[0].status for r in await write(node, 3)] == ["improved"] * per_node
        await coalescer.close(5)
        warnings = log.lines(logging.WARNING)
        assert [m for m, _ in warnings] == ["shard write failed"] * 2, f"{len(warnings)} warnings"
        assert [(m, f["node"], f["failures"]) for m, f in warnings] == [
            ("shard write failed", first, 1),
            ("shard write failed", second, 1),
        ], warnings
        for (_, fields), node in zip(warnings, (first, second), strict=True):
            assert fields["error"] in {described(e) for e in failures[node]}  # the first failure's
            assert fields["board"] == "outage" and fields["scores"] == 1
        assert [(m, f["node"], f["failures"]) for m, f in log.lines(logging.INFO)] == [
            ("shard writes work again", first, per_node),
            ("shard writes work again", second, per_node),
        ]
    finally:
        await client.aclose()
        local.down()


async def test_the_outage_of_a_primary_gone_from_the_slot_map_ends_at_a_call_that_works(
    store: BoardStore,
) -> None:
    """A primary whose replica took over (or "unknown", while the slot map was refreshed) gets no
    call again, so no call through it can end its outage: it ends at the first call that works
    through another primary, and a later failure through that name is a new outage, logged at once."""
    board, _ = await store.create(BoardConfig.from_dict(board_name(), {}))
    gone = "127.0.0.1:1"
    node = [gone]
    coalescer = Coalescer(delay_s=0.001, node_of=lambda b, s: node[0])
    journal_max = board.journal_max
    try:
        with kept("shardlb.router") as log:
            board.journal_max = 0  # every call refused (JOURNALFULL): real failures, nothing applied
            for i in range(3):
                with pytest.raises(Overloaded):
                    await coalescer.submit(board, board.prepare([Score(f"p{i}", 1, "m")]))
            board.journal_max, node[0] = journal_max, primary_of(board, 0)  # the promoted replica
            [result] = await coalescer.submit(board, board.prepare([Score("p0", 1, "m")]))
            assert result.status == "improved"
            board.journal_max, node[0] = 0, gone
            with pytest.raises(Overloaded):
                await coalescer.submit(board, board.prepare([Score("p1", 1, "m")]))
        await coalescer.close(5)
        assert [(m, f["node"], f["failures"]) for m, f in log.lines(logging.WARNING)] == [
            ("shard write failed", gone, 1),
            ("shard write failed", gone, 1),
        ]
        [(message, fields)] = log.lines(logging.INFO)
        assert (message, fields["node"], fields["left_slot_map"], fields["failures"]) == (
            "shard writes work again",
            gone,
            True,
            3,
        )
    finally:
        board.journal_max = journal_max
        await store.delete(board.config.id)
