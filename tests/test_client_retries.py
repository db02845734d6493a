"""The client's retries and its ScoreBuffer: the backoff schedule (no server), many tasks through the
buffer, a retry storm of refused and cut-off writes that must still count each result once, and
the deadline that bounds every call."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from shardlb.client import (
    AsyncClient,
    Backoff,
    InvalidRequest,
    MatchResult,
    RateLimited,
    ScoreBuffer,
    ScoreOutcome,
    TransportError,
    Unavailable,
)
from shardlb.client.errors import ApiError, ClientClosed, retry_after_seconds
from shardlb.config import BoardConfig
from tests.client_support import Served, expected_entries, free_port, reference_for, rows, served_router
from tests.router_support import ADMIN, board_name

FAST = Backoff(base=0.002, cap=0.02)


def test_backoff_is_full_jitter_under_a_doubling_cap_and_after_retry_after() -> None:
    backoff = Backoff(base=0.1, cap=0.8, rng=random.Random(1))
    for attempt, bound in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 0.8), (5000, 0.8)]:
        delays = [backoff.delay(attempt) for _ in range(2000)]
        assert 0 <= min(delays) < bound * 0.05 and bound * 0.95 < max(delays) <= bound
        after = [backoff.delay(attempt, retry_after=3.0) for _ in range(200)]
        assert all(3.0 <= d <= 3.0 + bound for d in after)


def test_retry_after_takes_seconds_and_http_dates() -> None:
    assert retry_after_seconds("1") == 1.0 and retry_after_seconds(" 2.5 ") == 2.5
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490.0) == 0.0
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None


def test_a_retry_after_date_without_a_zone_is_gmt(monkeypatch: pytest.MonkeyPatch) -> None:
    """RFC 9110 has recipients take asctime dates too, which name no zone but are GMT: parsed as
    local time, one of New York read 10 s as 4 hours and 10 s (a client audit's finding)."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        assert retry_after_seconds("Wed Oct 21 07:28:10 2015", now=1445412480.0) == 10.0
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.fixture(scope="module")
async def router(cluster: Any) -> AsyncIterator[Served]:
    async with served_router(cluster.url) as served:
        yield served


@pytest.fixture(autouse=True)
def calm(router: Served) -> None:
    router.faults.calm()


def _results(count: int, players: int, match: str, rng: random.Random) -> list[MatchResult]:
    now = int(time.time()) * 1000
    return [
        MatchResult(f"p{rng.randrange(players)}", rng.randrange(1, 100), f"{match}-{i}", now - i % 600 * 1000)
        for i in range(count)
    ]


async def _post_all(buffer: ScoreBuffer, board: str, mine: list[MatchResult]) -> list[ScoreOutcome]:
    """One game-server task: its results one after another, each awaited."""
    return [await buffer.post(board, r) for r in mine]


async def _check_board(
    client: AsyncClient, name: str, config: BoardConfig, results: list[MatchResult]
) -> None:
    expected = expected_entries(reference_for(config, results))
    assert rows([e async for e in client.iter_entries(name)]) == expected


@pytest.mark.cluster
async def test_score_buffer_gives_each_of_many_tasks_its_own_outcome(router: Served) -> None:
    rng = random.Random(7)
    boards = [board_name("buf"), board_name("buf")]
    configs = {b: BoardConfig.from_dict(b, {"mode": "incr", "sharding": {"shards": 4}}) for b in boards}
    per_task = {
        (b, t): _results(rng.randrange(1, 6), 60, f"{b}-t{t}", rng) for b in boards for t in range(150)
    }
    async with AsyncClient(router.url, ADMIN) as client:
        for board in boards:
            await client.put_board(board, mode="incr", sharding={"shards": 4})
        writes = router.faults.counts["writes"]
        async with ScoreBuffer(client, max_scores=50, max_delay_ms=5) as buffer:
            tasks = {
                key: asyncio.create_task(_post_all(buffer, key[0], mine)) for key, mine in per_task.items()
            }
            # One bad result among them fails its own caller only.
            with pytest.raises(InvalidRequest) as bad:
                await buffer.post(boards[0], MatchResult("cheater", 10**9, "bad-1"))
            outcomes = {key: await task for key, task in tasks.items()}
        requests = router.faults.counts["writes"] - writes
        assert bad.value.field == "scores[0].points" and bad.value.code == "out_of_range"
        for key, mine in per_task.items():
            assert [(o.player_id, o.match_id, o.status) for o in outcomes[key]] == [
                (r.player_id, r.match_id, "improved") for r in mine
            ]
        posted = sum(len(m) for m in per_task.values())
        assert requests < posted / 5  # batched: without the buffer, one request per result
        for board in boards:
            mine = [r for (b, _), rs in per_task.items() if b == board for r in rs]
            await _check_board(client, board, configs[board], mine)
        # A ClientError as every other failure of the client (a RuntimeError until 2026-12-05)
        with pytest.raises(ClientClosed, match="closed"):
            await buffer.post(boards[0], MatchResult("late", 1, "late-1"))


@pytest.mark.cluster
async def test_retry_storm_counts_every_result_once(router: Served) -> None:
    """A third of the writes are refused with 503 before the router sees them, a third are applied
    and then cut off before their answer; an incr board would count any result sent twice twice."""
    rng = random.Random(11)
    name = board_name("storm")
    config = BoardConfig.from_dict(name, {"mode": "incr", "sharding": {"shards": 4}})
    buffered = {t: _results(rng.randrange(1, 4), 80, f"b{t}", rng) for t in range(120)}
    direct = {t: _results(rng.randrange(1, 30), 80, f"d{t}", rng) for t in range(40)}
    async with AsyncClient(router.url, ADMIN, deadline=120, backoff=FAST) as client:
        await client.put_board(name, mode="incr", sharding={"shards": 4})
        router.faults.refuse, router.faults.drop = 1 / 3, 1 / 3
        before = router.faults.counts.copy()
        async with ScoreBuffer(client, max_scores=20, max_delay_ms=2) as buffer:
            through_buffer = [asyncio.create_task(_post_all(buffer, name, m)) for m in buffered.values()]
            alone = [asyncio.create_task(client.post_scores(name, m)) for m in direct.values()]
            outcomes = await asyncio.gather(*through_buffer, *alone)
        router.faults.calm()
        refused = router.faults.counts["refused"] - before["refused"]
        dropped = router.faults.counts["dropped"] - before["dropped"]
        assert refused >= 10 and dropped >= 10  # the storm happened
        sent = [*buffered.values(), *direct.values()]
        for mine, got in zip(sent, outcomes, strict=True):
            assert [(o.player_id, o.match_id) for o in got] == [(r.player_id, r.match_id) for r in mine]
            # "duplicate": an earlier attempt was applied and its answer lost.
            assert {o.status for o in got} <= {"improved", "duplicate"}
        assert any(o.status == "duplicate" for got in outcomes for o in got)
        await _check_board(client, name, config, [r for mine in sent for r in mine])


@pytest.mark.cluster
async def test_the_deadline_bounds_the_retries(router: Served) -> None:
    name = board_name("late")
    async with AsyncClient(router.url, ADMIN, backoff=FAST) as client:
        await client.put_board(name)
        router.faults.refuse = 1.0
        with pytest.raises(Unavailable) as storm:
            await client.post_scores(name, [MatchResult("alice", 5, "m1")], deadline=0.3)
        assert storm.value.code == "overloaded" and storm.value.attempts > 1
        # Every attempt reached the router, but for the last one when the deadline cut it short.
        seen = router.faults.seen[storm.value.request_id or ""]
        assert storm.value.attempts - 1 <= seen <= storm.value.attempts
        # A Retry-After past the deadline: no point waiting for it, the error comes at once.
        router.faults.retry_after = "30"
        with pytest.raises(Unavailable) as told:
            await client.post_scores(name, [MatchResult("alice", 5, "m1")], deadline=5)
        assert told.value.retry_after == 30 and told.value.attempts == 1
        router.faults.calm()
        assert (await client.get_board(name)).players == {"total": 0}
    async with AsyncClient(f"http://127.0.0.1:{free_port()}", backoff=FAST) as nowhere:
        with pytest.raises(TransportError) as refused:
            await nowhere.top(name, deadline=0.3)
        assert refused.value.attempts > 1


@pytest.mark.cluster
async def test_rate_limited_reads_wait_for_retry_after(cluster: Any) -> None:
    """The router's own read limiter: 429 with Retry-After (1 s at least) is waited for when the
    deadline leaves room, and raised at once when it does not."""
    async with served_router(cluster.url, read_rate=1.0, read_burst=1) as served:
        name = board_name("rate")
        async with AsyncClient(served.url, ADMIN) as admin:
            await admin.put_board(name)
            await admin.post_scores(name, [MatchResult("alice", 5, "m1")])
        async with AsyncClient(served.url, backoff=FAST) as anonymous:  # limited by address
            assert [e.player_id for e in (await anonymous.top(name)).entries] == ["alice"]
            with pytest.raises(RateLimited) as limited:
                await anonymous.top(name, deadline=0.5)
            assert limited.value.code == "rate_limited" and limited.value.retry_after == 1
            assert limited.value.attempts == 1
            page = await anonymous.top(name, deadline=10)
            assert [e.player_id for e in page.entries] == ["alice"]
        assert max(served.faults.seen.values()) == 2  # that last call: a 429, then its retry


async def test_a_redirect_is_an_error_not_an_answer() -> None:
    """The router never redirects; a 3xx comes from something in between (a proxy, a login page)
    and carries no API body. It was taken as a success and its empty body failed to parse (a
    TypeError or KeyError from deep in the client); it is an ApiError naming the status."""
    answers = [0]

    def redirect(request: httpx.Request) -> httpx.Response:
        answers[0] += 1
        return httpx.Response(302, headers={"Location": "http://elsewhere.test/"}, content=b"")

    async with AsyncClient(
        "http://router.test", "k", format="json", transport=httpx.MockTransport(redirect)
    ) as c:
        with pytest.raises(ApiError) as raised:
            await c.get_board("b")
    assert (raised.value.status, raised.value.code, answers[0]) == (302, "http_302", 1)


@pytest.mark.cluster
async def test_a_buffered_batch_with_refused_results_keeps_one_deadline(router: Served) -> None:
    """Each result the server refuses makes the buffer send the rest of its batch again: those
    requests share the batch's one deadline (each used to get a whole deadline of its own)."""
    name = board_name("refused")
    async with AsyncClient(router.url, ADMIN, backoff=FAST) as client:
        await client.put_board(name)
        deadlines: list[float] = []
        post_scores = client.post_scores

        async def spied(board: str, results: Any, *, deadline: float | None = None) -> Any:
            deadlines.append(deadline if deadline is not None else client.deadline)
            return await post_scores(board, results, deadline=deadline)

        client.post_scores = spied  # type: ignore[method-assign]
        async with ScoreBuffer(client, max_scores=10, max_delay_ms=50, deadline=30) as buffer:
            posts = [
                buffer.post(name, MatchResult(f"p{i}", 10**9 if i % 3 == 0 else i, f"m{i}"))
                for i in range(10)
            ]
            done = await asyncio.gather(*posts, return_exceptions=True)
        assert [isinstance(d, ApiError) for d in done] == [i % 3 == 0 for i in range(10)]
        assert len(deadlines) == 5  # the batch, then again after each of its 4 refused results
        assert deadlines[0] <= 30 and all(b < a for a, b in itertools.pairwise(deadlines))


async def test_a_buffer_forgets_a_board_once_its_results_are_answered(router: Served) -> None:
    """A game server posting to a new board name per event (a board per tournament) keeps one buffer
    for its life: the lane of a board with nothing held or in flight is dropped, and a later post
    to it gets a new one. Until 2026-12-05 every board name posted to stayed in the buffer."""
    names = [board_name(f"lanes{i}") for i in range(3)]
    async with AsyncClient(router.url, ADMIN, backoff=FAST) as client:
        for name in names:
            await client.put_board(name)
        async with ScoreBuffer(client, max_scores=5, max_delay_ms=1) as buffer:
            for round_no in range(2):
                posts = [
                    buffer.post(n, MatchResult(f"p{i}", i + 1 + 10 * round_no, f"r{round_no}-m{i}"))
                    for n in names
                    for i in range(7)
                ]
                outcomes = await asyncio.gather(*posts)
                assert [o.status for o in outcomes] == ["improved"] * 21
                assert buffer._lanes == {}  # nothing held: no board's lane kept
        for name in names:
            assert len([e async for e in client.iter_entries(name)]) == 7
