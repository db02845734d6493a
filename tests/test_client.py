"""shardlb.client against the real router over TCP: every call's answer checked against the
reference board, in both formats; errors mapped to their exceptions and never retried when 4xx;
the blocking ``Client`` from threads."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from shardlb.client import (
    AsyncClient,
    BoardClosed,
    BoardNotFound,
    Client,
    Conflict,
    Entry,
    Forbidden,
    InvalidRequest,
    MatchResult,
    PlayerNotFound,
    Unauthorized,
)
from shardlb.config import BoardConfig
from shardlb.store import BoardStore
from tests.client_support import Served, expected_entries, rows, served_router, submit
from tests.reference import ReferenceBoard
from tests.router_support import ADMIN, READ, WRITE, board_name

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
async def router(cluster: Any) -> AsyncIterator[Served]:
    async with served_router(cluster.url) as served:
        yield served


def _results(rng: random.Random, count: int, players: int, match: str) -> list[MatchResult]:
    now = int(time.time()) * 1000
    return [
        MatchResult(
            f"p{rng.randrange(players)}",
            rng.randrange(0, 5000),
            f"{match}-{i}",
            achieved_at=now - rng.randrange(0, 3600) * 1000,
        )
        for i in range(count)
    ]


@pytest.mark.parametrize("format", ["msgpack", "json"])
async def test_board_admin_round_trip(router: Served, format: str) -> None:
    name = board_name("cl")
    async with AsyncClient(router.url, ADMIN, format=format) as client:
        settings: dict[str, Any] = {"mode": "incr", "periods": ["total", "daily"], "sharding": {"shards": 4}}
        created = await client.put_board(name, **settings)
        assert created.created is True and created.id == name and created.mode == "incr"
        assert created.periods == ["total", "daily"] and created.sharding == {"strategy": "hash", "shards": 4}
        again = await client.put_board(name, **settings)
        assert again.created is False and again.settings == created.settings
        with pytest.raises(Conflict) as conflict:
            await client.put_board(name, mode="best")
        assert conflict.value.status == 409 and conflict.value.code == "board_conflict"
        got = await client.get_board(name)
        assert (
            got.players == {"total": 0, "daily": 0}
            and got.settings == created.settings
            and got.closed is False
        )
        assert got.resets_at is not None and set(got.resets_at) == {"daily"} and created.resets_at is None
        assert name in [b.id for b in await client.list_boards()]
        await client.delete_board(name)
        with pytest.raises(BoardNotFound) as missing:
            await client.get_board(name)
        assert missing.value.status == 404 and missing.value.code == "board_not_found"
        with pytest.raises(BoardNotFound):
            await client.delete_board(name)


async def test_a_closed_board_raises_board_closed(router: Served, store: BoardStore) -> None:
    name = board_name("cl")
    async with AsyncClient(router.url, ADMIN) as client:
        await client.put_board(name, sharding={"shards": 2})
        await (await store.get(name)).close()  # as a season's archive does first
        with pytest.raises(BoardClosed) as closed:
            await client.post_scores(name, [MatchResult("p1", 10, "m1")])
        assert (closed.value.status, closed.value.code) == (409, "board_closed")
        info = await client.get_board(name)
        assert (info.players, info.closed) == ({"total": 0}, True) and "closed" not in info.settings
        await client.delete_board(name)


@pytest.mark.parametrize("format", ["msgpack", "json"])
async def test_every_read_matches_the_reference(router: Served, format: str) -> None:
    name = board_name("cl")
    rng = random.Random(format)
    results = _results(rng, 2500, 400, "m")  # more than one request's 1000
    async with AsyncClient(router.url, ADMIN, format=format) as client:
        await client.put_board(name, periods=["total", "daily"], sharding={"shards": 4})
        config = BoardConfig.from_dict(name, {"periods": ["total", "daily"], "sharding": {"shards": 4}})
        reference = ReferenceBoard(config)
        statuses = submit(reference, results)
        writes = router.faults.counts["writes"]
        outcomes = await client.post_scores(name, results)
        assert router.faults.counts["writes"] - writes == 3
        assert [(o.player_id, o.match_id) for o in outcomes] == [(r.player_id, r.match_id) for r in results]
        assert [(o.status, o.points) for o in outcomes] == statuses
        expected = expected_entries(reference)

        top = await client.top(name, 10)
        assert top.board == name and top.period == "total" and rows(top.entries) == expected[:10]
        page = await client.entries(name, 95, 20)
        assert rows(page.entries) == expected[95:115]
        every = [e async for e in client.iter_entries(name, page_size=64)]
        assert rows(every) == expected
        daily = await client.top(name, 5, period="daily")
        assert daily.period.startswith("daily:")

        for rank, player, points, _ in (expected[0], expected[len(expected) // 2], expected[-1]):
            found = await client.player(name, player)
            assert (found.rank, found.points, found.players) == (rank, points, len(expected))
            assert found.percentile == pytest.approx(100 * (len(expected) - rank) / len(expected))
            assert found.rank_error is None and found.counts_as_of is None
            kept = await client.player(name, player, max_age_ms=1000)  # nothing written since: exact
            assert (kept.rank, kept.players) == (rank, len(expected)) and kept.counts_as_of is not None
            estimate = await client.player(name, player, estimate=True)
            assert estimate.rank_error is not None and abs(estimate.rank - rank) <= estimate.rank_error
        middle = expected[len(expected) // 2]
        assert rows(await client.around(name, middle[1], 3)) == expected[middle[0] - 4 : middle[0] + 3]

        # A friends list past the API's 1000 ids, with unknown and repeated ids: merged by rank.
        asked = [f"p{i}" for i in range(1200)] + [f"nobody{i}" for i in range(300)] + ["p7", "p7"]
        rng.shuffle(asked)
        friends = await client.query(name, asked)
        assert rows(friends) == [row for row in expected if row[1] in set(asked)]
        assert await client.query(name, []) == []


async def test_errors_carry_status_code_field_and_request_id_and_4xx_are_sent_once(router: Served) -> None:
    name = board_name("cl")
    async with AsyncClient(router.url, ADMIN) as admin:
        await admin.put_board(name)
        await admin.post_scores(name, [MatchResult("alice", 10, "m1")])
    seen = router.faults.seen
    async with AsyncClient(router.url, "no-such-key") as stranger:
        with pytest.raises(Unauthorized) as unknown:
            await stranger.top(name)
    assert unknown.value.status == 401 and unknown.value.code == "unauthorized"
    async with AsyncClient(router.url, READ) as reader:
        with pytest.raises(Forbidden) as small:
            await reader.put_board(board_name("cl"))
        assert small.value.code == "forbidden"
        with pytest.raises(PlayerNotFound) as nobody:
            await reader.player(name, "bob")
        assert nobody.value.code == "player_not_found"
        with pytest.raises(InvalidRequest) as too_many:
            await reader.top(name, 5000)
        assert (too_many.value.status, too_many.value.field) == (422, "limit")
    async with AsyncClient(router.url, WRITE) as writer:
        with pytest.raises(InvalidRequest) as bad:
            await writer.post_scores(name, [MatchResult("bob", 5, "m2"), MatchResult("carol", 10**9, "m2")])
        assert (bad.value.status, bad.value.code) == (422, "out_of_range")
        assert bad.value.field == "scores[1].points"
        assert (await writer.get_board(name)).players == {"total": 1}  # nothing of it written
        # More than one request's 1000: the error names the caller's index, and carries what went in.
        many = [MatchResult(f"many{i}", 5, "m3") for i in range(1500)]
        many[1003] = MatchResult("many1003", 10**9, "m3")
        with pytest.raises(InvalidRequest) as later:
            await writer.post_scores(name, many)
        assert later.value.field == "scores[1003].points"
        assert [(o.player_id, o.status) for o in later.value.applied] == [
            (f"many{i}", "improved") for i in range(1000)
        ]
    for error in (unknown.value, small.value, nobody.value, too_many.value, bad.value):
        assert error.request_id is not None and error.attempts == 1
        assert seen[error.request_id] == 1
    with pytest.raises(ValueError, match="match id"):
        MatchResult("alice", 10, "")


async def test_a_keys_surrounding_whitespace_is_dropped_and_a_key_no_router_holds_is_refused_unshown(
    router: Served,
) -> None:
    """A key read from a file (a mounted secret) ends with a newline, which no header may carry:
    every call failed as a ``TransportError`` quoting the key (h11's "Illegal header value
    b'Bearer ...'"), into the game server's logs. The router strips its own keys
    (``SHARDLB_WRITE_KEYS``) and the key it is presented, so the client strips the key's
    surrounding whitespace too; a key no router holds (a space or a control character inside, a
    letter outside ASCII) is a ``ValueError`` when the client is made, which does not show it."""
    name = board_name("cl")
    async with AsyncClient(router.url, ADMIN) as admin:
        await admin.put_board(name)
    async with AsyncClient(router.url, f" {WRITE}\r\n") as writer:
        [posted] = await writer.post_scores(name, [MatchResult("alice", 5, "m1")])
    assert posted.status == "improved"
    for bad in ["secret key", "secret\nkey", "s\u00e9cret", "secret\x00key"]:
        with pytest.raises(ValueError, match="printable ASCII") as refused:
            AsyncClient(router.url, bad)
        assert "secret" not in str(refused.value) and "cret" not in str(refused.value)
        with pytest.raises(ValueError, match="printable ASCII"):
            Client(router.url, bad)


async def test_blocking_client_from_threads(router: Served) -> None:
    name = board_name("cl")

    def use() -> tuple[list[Entry], list[str], int, list[Entry], list[Entry]]:
        with Client(router.url, ADMIN, format="json") as client:
            client.put_board(name, mode="incr", sharding={"shards": 3})
            posted = client.post_scores(name, [MatchResult("alice", 3, "m0"), MatchResult("bob", 1, "m0")])
            with client.buffer(max_scores=10, max_delay_ms=5) as buffer:

                def one_thread(i: int) -> str:
                    return buffer.post(name, MatchResult(f"t{i % 5}", 1, f"m{i}")).status

                with ThreadPoolExecutor(8) as pool:
                    statuses = list(pool.map(one_thread, range(40)))
            top = client.top(name, 3).entries
            rank = client.player(name, "alice").rank
            everyone = list(client.iter_entries(name, page_size=2))
            friends = client.query(name, ["bob", "t1"])
            assert [e.player_id for e in client.entries(name, 5, 10).entries] == ["alice", "bob"]
            assert [e.player_id for e in client.around(name, "alice", 1)][1:] == ["alice", "bob"]
            assert client.get_board(name).players == {"total": 7}
            assert name in [b.id for b in client.list_boards()]
            client.delete_board(name)
            assert [o.status for o in posted] == ["improved", "improved"]
            return top, statuses, rank, everyone, friends

    top, statuses, rank, everyone, friends = await asyncio.to_thread(use)
    assert statuses == ["improved"] * 40
    assert [e.points for e in top] == [8, 8, 8]  # five players tie at 8
    assert rank == 6 and len(everyone) == 7 and [e.rank for e in everyone] == list(range(1, 8))
    assert [e.player_id for e in friends] == ["t1", "bob"]
