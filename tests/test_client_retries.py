"""The client's retries and its ScoreBuffer: the backoff schedule (no server), many tasks through the
buffer, a retry storm of refused and cut-off writes that must still count each result once, and
the deadline that bounds every call."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shardlb import times
from shardlb.board import Score
from shardlb.client import (
    AsyncClient,
    Backoff,
    BoardRebuilding,
    BoardResharding,
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
from shardlb.rebuild import connected
from shardlb.store import BoardStore
from tests.client_support import (
    DroppedAnswer,
    Served,
    expected_entries,
    free_port,
    reference_for,
    rows,
    served_router,
)
from tests.router_support import ADMIN, board_name
from tests.test_board import expected_entries as board_expected
from tests.test_rebuild import OnlyStore, archiver, drain, own_archive
from tests.test_rebuild_jobs import lost
from tests.test_rebuild_window import reference, restored
from tests.test_shard_loss import slot_wiped

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
async def test_a_write_whose_answers_were_lost_names_the_request_id_the_router_logged(router: Served) -> None:
    """A write whose every answer is lost after the router applied it: the ``TransportError``
    carries the one ``X-Request-Id`` its attempts sent, which the router's logs hold, so a game
    server can find out what became of it. It carried none (a client audit's finding): only an
    ``ApiError`` did, and whether a lost write arrived is what the router's logs are asked."""
    name = board_name("lost")
    async with AsyncClient(router.url, ADMIN, backoff=FAST) as client:
        await client.put_board(name)
        router.faults.drop = 1.0
        with pytest.raises(TransportError) as lost:
            await client.post_scores(name, [MatchResult("alice", 5, "m1")], deadline=0.5)
        router.faults.calm()
        request_id = lost.value.request_id
        assert request_id is not None and router.faults.seen[request_id] >= 1
        assert lost.value.attempts - 1 <= router.faults.seen[request_id] <= lost.value.attempts
        # Applied by the attempts whose answers were lost: sent again, it is recognised.
        again = await client.post_scores(name, [MatchResult("alice", 5, "m1")])
        assert [(o.status, o.points) for o in again] == [("unchanged", 5)]


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


# The service's refusals that say "come back later" (api.md, router/errors.py, docs/design-notes.md):
# code, status, Retry-After. A shard lost alone is ``board_rebuilding`` too ("A shard lost alone").
LATER = [
    ("board_rebuilding", 503, "5"),
    ("board_resharding", 503, "1"),
    ("overloaded", 503, "1"),
    ("cluster_unavailable", 503, "1"),
    ("rate_limited", 429, "1"),
]


@dataclass(frozen=True)
class _Told(Backoff):
    """Records the Retry-After the client hands it on each retry, and waits nothing."""

    told: list[float | None] = field(default_factory=list)

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        self.told.append(retry_after)
        return 0.0


def _refusing(refusals: list[tuple[str, int, str]], seen: list[httpx.Request]) -> httpx.MockTransport:
    """Answers each refusal in turn, then the write's results."""

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) <= len(refusals):
            code, status, wait = refusals[len(seen) - 1]
            body = {"error": {"code": code, "message": f"refused by the test ({code})", "field": None}}
            return httpx.Response(status, json=body, headers={"retry-after": wait})
        results = [{"player_id": "p", "match_id": "m", "status": "improved", "points": 5}]
        return httpx.Response(200, json={"results": results})

    return httpx.MockTransport(handler)


async def test_each_refusal_for_later_is_retried_as_the_same_call_after_its_retry_after() -> None:
    """A write refused with each of the service's "come back later" answers is sent again: the same
    body (its match ids) and the same X-Request-Id on every attempt, each wait at least the answer's
    Retry-After, until the service takes it."""
    seen: list[httpx.Request] = []
    backoff = _Told()
    transport = _refusing(LATER, seen)
    async with AsyncClient("http://r.test", "k", format="json", backoff=backoff, transport=transport) as c:
        [outcome] = await c.post_scores("b", [MatchResult("p", 5, "m")], deadline=60)
    assert outcome.status == "improved" and len(seen) == len(LATER) + 1
    assert len({r.headers["x-request-id"] for r in seen}) == 1
    assert len({r.content for r in seen}) == 1
    assert backoff.told == [float(wait) for _, _, wait in LATER]


@pytest.mark.parametrize(("code", "status", "wait"), LATER, ids=[code for code, _, _ in LATER])
async def test_a_refusal_that_outlasts_the_deadline_is_raised_typed_at_once(
    code: str, status: int, wait: str
) -> None:
    """A Retry-After past what is left of the deadline: no attempt more, the refusal raised as its own
    type (a board being rebuilt or resharded is told from an overloaded router) with its Retry-After,
    so a game server can keep the results and post them again later with the same match ids."""
    seen: list[httpx.Request] = []
    transport = _refusing([(code, status, "30")] * 3, seen)
    async with AsyncClient("http://r.test", "k", format="json", transport=transport) as c:
        with pytest.raises(ApiError) as raised:
            await c.post_scores("b", [MatchResult("p", 5, "m")], deadline=5)
    kinds = {
        "board_rebuilding": BoardRebuilding,
        "board_resharding": BoardResharding,
        "overloaded": Unavailable,
        "cluster_unavailable": Unavailable,
        "rate_limited": RateLimited,
    }
    error = raised.value
    assert type(error) is kinds[code] and isinstance(error, Unavailable if status == 503 else RateLimited)
    assert (error.status, error.code, error.retry_after) == (status, code, 30)
    assert error.attempts == 1 and len(seen) == 1
    assert error.retryable


async def test_an_invalid_request_id_is_never_sent_again() -> None:
    """400 ``invalid_request_id`` (two X-Request-Id headers that differ, which a proxy may add): the
    request is wrong as sent, and would be as wrong the second time."""
    seen: list[httpx.Request] = []
    transport = _refusing([("invalid_request_id", 400, "1")] * 3, seen)
    async with AsyncClient("http://r.test", "k", format="json", backoff=FAST, transport=transport) as c:
        with pytest.raises(InvalidRequest) as raised:
            await c.top("b")
    assert (raised.value.code, raised.value.attempts, len(seen)) == ("invalid_request_id", 1, 1)
    assert not raised.value.retryable


class _LostMidCall:
    """ASGI, in front of the router: with ``lose``, the first score write is applied, then ``lose``
    runs and the write's answer is cut off (the client cannot tell whether it was applied);
    ``rebuild`` runs on the first refusal, before the refusal goes out. ``answers``: each write's
    status and error code, as the router gave them."""

    def __init__(
        self, app: ASGIApp, lose: Callable[[], Awaitable[None]] | None, rebuild: Callable[[], Awaitable[None]]
    ) -> None:
        self.app, self.lose, self.rebuild = app, lose, rebuild
        self.answers: list[tuple[int, str | None]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (scope["type"] == "http" and scope["method"] == "POST" and scope["path"].endswith("/scores")):
            await self.app(scope, receive, send)
            return
        answer: list[Message] = []

        async def keep(message: Message) -> None:
            answer.append(message)

        await self.app(scope, receive, keep)
        status = answer[0]["status"]
        body = b"".join(m.get("body", b"") for m in answer[1:])
        self.answers.append((status, orjson.loads(body)["error"]["code"] if status >= 400 else None))
        if len(self.answers) == 1 and self.lose is not None:
            await self.lose()
            await send(answer[0])
            raise DroppedAnswer("the test cuts this answer off after the router applied the write")
        if status >= 400 and not any(s >= 400 for s, _ in self.answers[:-1]):
            await self.rebuild()
        for message in answer:
            await send(message)


@pytest.mark.cluster
@pytest.mark.parametrize("loss", ["shard-alone", "total", "shard-alone-first"])
async def test_a_write_retried_across_a_loss_of_redis_counts_once_once_the_board_is_back(
    router: Served, store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, loss: str
) -> None:
    """An incr board's write is applied and archived, its answer lost; Redis then loses one shard
    alone (its slot served again empty) or everything (`rebuild --all` restores the board). The
    client's retry is refused, 503 ``board_rebuilding`` with Retry-After 5; once the board is
    rebuilt the next retry, the same X-Request-Id and match ids, is answered ``duplicate`` with each
    player's total counting the result once, and the board agrees with the reference. Or the shard
    is lost before the write (``shard-alone-first``, not marked yet): the write is refused for its
    result on that shard, its results on the other shards applied or not, and the retry after the
    rebuild counts each result once all the same."""
    name = board_name(f"lost-{loss}")
    async with own_archive(postgres_url, "clientloss") as url:
        config = BoardConfig.from_dict(name, {"mode": "incr", "sharding": {"shards": 3}})
        board, _ = await store.create(config)
        now = times.now_ms() - 1000
        before = [Score(f"p{i}", 100 + 10 * i, f"m{i}", now) for i in range(30)]
        await board.submit(before)
        homes = {board.layout.home(s.player_id): s.player_id for s in before}
        late = [MatchResult(homes[shard], 7, "late", now) for shard in sorted(homes)]
        assert len(late) == 3  # one player of each shard

        async def lose() -> None:
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {name}), url)
            try:
                await drain(a)
            finally:
                await a.db.close()
            # Every key of the lost shard's slot, its sentinel too; or, for a total loss, every key
            # of every master (the board's record included): `rebuild --all` restores it.
            if loss == "total":
                await lost(raw)
                await restored(cluster_url, url)
            else:
                assert await slot_wiped(raw, board, 1) > 0

        async def rebuild_it() -> None:
            async with connected(cluster_url, url) as (rebuilder, other):
                await rebuilder.rebuild(await other.get(name), shard=None if loss == "total" else 1)

        first = loss == "shard-alone-first"
        if first:
            await lose()
        steps = _LostMidCall(router.faults.app, None if first else lose, rebuild_it)
        router.faults.app = steps
        try:
            async with AsyncClient(router.url, ADMIN, format="json", deadline=60) as client:
                outcomes = await client.post_scores(name, late)
            refused = steps.answers[:-1] if first else steps.answers[1:-1]
            assert steps.answers[-1] == (200, None) and (first or steps.answers[0] == (200, None))
            assert set(refused) == {(503, "board_rebuilding")}, steps.answers
            totals = {s.player_id: s.points for s in before}
            want = [(r.player_id, totals[r.player_id] + 7) for r in late]
            assert [(o.player_id, o.points) for o in outcomes] == want
            if first:  # the result on the lost shard was refused; the others may have been applied
                assert outcomes[1].status == "improved"
                assert {o.status for o in outcomes} <= {"improved", "duplicate"}
            else:
                assert {o.status for o in outcomes} == {"duplicate"}
            back = await store.get(name)
            assert not back.rebuilding
            sent = [*before, *(Score(r.player_id, r.points, r.match_id, now) for r in late)]
            assert await back.top(50) == board_expected(reference(back, sent), "total", None)
        finally:
            router.faults.app = steps.app
            with contextlib.suppress(Exception):
                await store.delete(name)
