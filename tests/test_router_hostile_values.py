"""Values a client can send that once reached a 500, a stuck archiver or unbounded PostgreSQL
connections: each is now a 4xx before anything is written, or waits its turn behind a small gate.

- A NUL character in a match id or a moderation reason: PostgreSQL text cannot hold it, so a
  journaled result carrying one failed every archive round of every board, for ever.
- Periods at the ends of the calendar (``daily:9999-12-31``): their end is past ``date.max``.
- Bodies nested deeper than Python's recursion limit, MessagePack maps with binary keys, and digits
  that are not ASCII (``"²".isdigit()`` is true, ``int("²")`` fails).
- Reads of settled periods and player histories open a PostgreSQL connection each: anonymous
  callers get a few at once per worker, not one each.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgpack
import orjson
import pytest

from router.gate import Gate
from shardlb import times
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.errors import InvalidInput
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running, service_of

pytestmark = pytest.mark.cluster


def error_of(r: httpx.Response) -> tuple[int, str, str | None]:
    body = r.json()
    return r.status_code, body["error"]["code"], body["error"]["field"]


def deep(levels: int) -> str:
    """JSON text of a number inside ``levels`` lists (encoders refuse to write such depths)."""
    return "[" * levels + "5" + "]" * levels


def json_with(body: dict[str, Any], field: str, raw: str) -> bytes:
    """``body`` as JSON with the value of ``field`` (at any depth) replaced by the JSON text ``raw``."""
    return orjson.dumps(body).replace(f'"{field}":"@"'.encode(), f'"{field}":{raw}'.encode())


@contextlib.asynccontextmanager
async def held(gate: Gate) -> AsyncIterator[None]:
    """Every permit of ``gate`` taken for the block, and given back after it."""
    for _ in range(gate.limit):
        await gate.acquire()
    try:
        yield
    finally:
        for _ in range(gate.limit):
            gate.release()


async def test_a_nul_in_a_match_id_is_refused_before_anything_is_written(
    store: BoardStore, cluster_url: str
) -> None:
    name = board_name("nul")
    board, _ = await store.create(BoardConfig.from_dict(name, {"mode": "incr", "durability": "journal"}))
    try:
        with pytest.raises(InvalidInput) as refused:
            board.prepare([Score("p", 1, "a\x00b")])
        assert (refused.value.field, refused.value.code) == ("scores[0].match_id", "invalid_match_id")
        async with running(cluster_url) as (_, client):
            r = await client.post(
                f"/v1/boards/{name}/scores",
                json={
                    "scores": [
                        {"player_id": "q", "points": 2, "match_id": "m1"},
                        {"player_id": "p", "points": 1, "match_id": "a\x00b"},
                    ]
                },
                headers=AS_WRITER,
            )
            assert error_of(r) == (422, "invalid_match_id", "scores[1].match_id")
            assert (await client.get(f"/v1/boards/{name}/players/q")).status_code == 404
            # every other character is still a match id's
            odd = "\x01\t é ☃ \U0001f600 \\ \" ' \u2028"
            ok = await client.post(
                f"/v1/boards/{name}/scores",
                json={"scores": [{"player_id": "p", "points": 1, "match_id": odd}]},
                headers=AS_WRITER,
            )
            assert ok.json()["results"][0]["status"] == "improved"
    finally:
        await store.delete(name)


async def test_a_nul_in_a_moderation_reason_is_422_not_a_retryable_503(
    store: BoardStore, cluster_url: str, postgres_url: str
) -> None:
    name = board_name("nul-reason")
    await store.create(BoardConfig.from_dict(name, {}))
    try:
        async with running(cluster_url, postgres_url=postgres_url) as (_, client):
            ban = await client.post(
                "/v1/players/nul-player:ban",
                json={"scope": "board", "board": name, "reason": "cheat\x00ing"},
                headers=AS_ADMIN,
            )
            assert error_of(ban) == (422, "invalid_input", "reason")
            removed = await client.delete(
                f"/v1/boards/{name}/players/nul-player", params={"reason": "x\x00"}, headers=AS_ADMIN
            )
            assert error_of(removed) == (422, "invalid_input", "reason")
            listed = (await client.get("/v1/bans", headers=AS_ADMIN)).json()
            assert "nul-player" not in str(listed)
    finally:
        await store.delete(name)


FAR_PERIODS = ["daily:9999-12-31", "weekly:9999-W52", "monthly:9999-12", "weekly:0001-W01"]


async def test_periods_at_the_ends_of_the_calendar_are_422(
    store: BoardStore, cluster_url: str, postgres_url: str
) -> None:
    """A week starting on Sunday puts weekly:0001-W01 before 0001-01-01; the others end after
    9999-12-31. Each read answers 422 invalid_period, with PostgreSQL (the settled-period lookup)
    and without; nearby periods read as any other."""
    name = board_name("far")
    settings = {
        "periods": ["total", "daily", "weekly", "monthly"],
        "timezone": "Asia/Tokyo",
        "week_start": "sunday",
    }
    await store.create(BoardConfig.from_dict(name, settings))
    try:
        for archive in ({}, {"postgres_url": postgres_url}):
            async with running(cluster_url, **archive) as (_, client):
                for period in FAR_PERIODS:
                    for path in ("top", "entries", "players/p", "players/p/around"):
                        r = await client.get(f"/v1/boards/{name}/{path}", params={"period": period})
                        assert error_of(r) == (422, "invalid_period", "period"), (path, period, r.text)
                    r = await client.post(
                        f"/v1/boards/{name}/players:query", json={"player_ids": ["p"], "period": period}
                    )
                    assert error_of(r) == (422, "invalid_period", "period"), (period, r.text)
                for period in ("daily:9999-12-30", "weekly:9999-W51", "monthly:9999-11", "daily:0001-01-01"):
                    r = await client.get(f"/v1/boards/{name}/top", params={"period": period})
                    assert r.status_code == 200 and r.json()["entries"] == [], (period, r.text)
        async with running(cluster_url, postgres_url=postgres_url) as (_, client):
            r = await client.post(
                f"/v1/boards/{name}/periods/daily:9999-12-31:settle",
                json={"settlement_id": "far", "rewards": [{"ranks": [1, 1], "reward": "gold"}]},
                headers=AS_ADMIN,
            )
            assert error_of(r)[:2] == (422, "invalid_period"), r.text
    finally:
        await store.delete(name)


async def test_deep_bodies_and_binary_keys_are_4xx(store: BoardStore, cluster_url: str) -> None:
    """A value nested in 40 or 1000 lists (orjson reads up to 1024; Python recursion stops near
    1000) in each field of a score and of a board's settings: 4xx, nothing written."""
    name = board_name("deep")
    await store.create(BoardConfig.from_dict(name, {}))
    as_json = {"Content-Type": "application/json"}
    async with running(cluster_url) as (_, client):
        try:
            for levels in (40, 1000):
                for field in ("points", "player_id", "match_id", "achieved_at", "region"):
                    player = "r" if field == "region" else "p"
                    item = {"player_id": player, "points": 1, "match_id": "m", field: "@"}
                    r = await client.post(
                        f"/v1/boards/{name}/scores",
                        content=json_with({"scores": [item]}, field, deep(levels)),
                        headers={**AS_WRITER, **as_json},
                    )
                    if field == "region" and levels == 40:  # ignored on a hash board (api.md)
                        assert r.status_code == 200, r.text
                        continue
                    if field == "region":  # past orjson's 254 levels the body is decoded again, key
                        # by key, to look for a repeated key (router/media.py), and Python's
                        # recursion stops near 1000: the body is refused whole
                        assert error_of(r)[:2] == (400, "malformed_body"), r.text
                        continue
                    assert 400 <= r.status_code < 500 and "error" in r.json(), (field, levels, r.text)
                    assert (await client.get(f"/v1/boards/{name}/players/p")).status_code == 404
                for field in ("mode", "periods", "retention_days", "sharding"):
                    r = await client.put(
                        f"/v1/boards/{board_name()}",
                        content=json_with({field: "@"}, field, deep(levels)),
                        headers={**AS_ADMIN, **as_json},
                    )
                    assert 400 <= r.status_code < 500 and "error" in r.json(), (field, levels, r.text)
            packed = msgpack.packb({b"mode": "best"}, use_bin_type=True)
            r = await client.put(
                f"/v1/boards/{board_name()}",
                content=packed,
                headers={**AS_ADMIN, "Content-Type": "application/msgpack"},
            )
            assert error_of(r) == (422, "unknown_field", "mode"), r.text
        finally:
            await store.delete(name)


async def test_digits_that_are_not_ascii_are_refused(cluster_url: str, postgres_url: str) -> None:
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        r = await client.get("/v1/settlements/nobody/awards", params={"after": "²"}, headers=AS_WRITER)
        assert error_of(r) == (422, "invalid_cursor", "after"), r.text
        r = await client.post(
            "/v1/settlements/nobody/awards:ack", json={"award_ids": ["²"]}, headers=AS_ADMIN
        )
        assert error_of(r) == (422, "invalid_award_id", "award_ids[0]"), r.text


async def test_public_archive_reads_wait_for_a_few_connections(
    store: BoardStore, cluster_url: str, postgres_url: str
) -> None:
    """With every permit of the worker's archive-read gate held, an anonymous history read, a read
    of a closed period and the periods list are 503 overloaded rather than one more connection
    each; let go, they answer again."""
    name = board_name("gated")
    await store.create(BoardConfig.from_dict(name, {"periods": ["total", "daily"]}))
    try:
        async with running(cluster_url, postgres_url=postgres_url, queue_wait_s=0.05) as (app, client):
            svc = service_of(app)
            assert isinstance(svc.archive_reads, Gate) and svc.archive_reads.limit >= 1
            paths = [
                f"/v1/boards/{name}/players/p/history",
                f"/v1/boards/{name}/top?period=daily:2026-01-01",
            ]
            for path in paths:
                assert (await client.get(path)).status_code in (200, 404)
            async with held(svc.archive_reads):  # every permit taken: a read that waits for one is 503
                for path in paths:
                    if "period=" in path:
                        path = path.replace("2026-01-01", "2026-01-02")  # not yet known as unsettled
                    assert error_of(await client.get(path))[:2] == (503, "overloaded"), path
            for path in paths:
                assert (await client.get(path)).status_code in (200, 404)
            async with held(svc.reads):  # every permit taken: a read that waits for one is 503
                r = await client.get(f"/v1/boards/{name}/periods")
                assert error_of(r)[:2] == (503, "overloaded"), r.text
            assert (await client.get(f"/v1/boards/{name}/periods")).status_code == 200
    finally:
        await store.delete(name)


async def test_reads_of_periods_before_the_epoch_never_wait_for_the_archive(
    store: BoardStore, cluster_url: str, postgres_url: str
) -> None:
    """No result is achieved before a board's epoch, so a period that ends by then holds none and
    can never be settled (shardlb/settlement.py refuses it). Its reads are answered without asking
    PostgreSQL whether it is settled: anonymous callers naming every day of the centuries before
    the epoch would each cost a connection to the archive for a read the router answers empty.
    Here every permit of the archive-read gate is held: a read that asked would be 503."""
    name = board_name("pre-epoch")
    settings = {"periods": ["total", "daily", "weekly", "monthly"], "epoch": "2020-01-01T00:00:00Z"}
    await store.create(BoardConfig.from_dict(name, settings))
    try:
        async with running(cluster_url, postgres_url=postgres_url, queue_wait_s=0.05) as (app, client):
            svc = service_of(app)
            async with held(svc.archive_reads):  # every permit taken: a read that waits for one is 503
                for period in ("daily:2019-12-31", "weekly:1999-W10", "monthly:0001-01"):
                    r = await client.get(f"/v1/boards/{name}/top", params={"period": period})
                    assert r.status_code == 200, (period, r.text)
                    assert r.json()["entries"] == [] and r.json()["period"] == period
                    r = await client.get(f"/v1/boards/{name}/players/p", params={"period": period})
                    assert error_of(r)[:2] == (404, "player_not_found"), (period, r.text)
                # The first period after the epoch may be settled: that read still asks.
                r = await client.get(f"/v1/boards/{name}/top", params={"period": "daily:2020-01-01"})
                assert error_of(r)[:2] == (503, "overloaded"), r.text
    finally:
        await store.delete(name)


async def test_a_malformed_read_parameter_is_422_before_the_archive_is_asked(
    store: BoardStore, cluster_url: str, postgres_url: str
) -> None:
    """A read of a closed period asks PostgreSQL whether it is settled; its parameters are checked
    before that, so a malformed one is the caller's 422 whatever the archive's state (here every
    permit of the archive-read gate is held: a read that asked would be 503)."""
    name = board_name("bad-flag")
    await store.create(BoardConfig.from_dict(name, {"periods": ["total", "daily"]}))
    try:
        async with running(cluster_url, postgres_url=postgres_url, queue_wait_s=0.05) as (app, client):
            svc = service_of(app)
            async with held(svc.archive_reads):  # every permit taken: a read that waits for one is 503
                wrong = {"period": "daily:2026-01-02", "estimate": "maybe"}
                r = await client.get(f"/v1/boards/{name}/players/p", params=wrong)
                assert error_of(r) == (422, "invalid_parameter", "estimate"), r.text
    finally:
        await store.delete(name)


async def test_reads_of_periods_that_can_hold_nothing_keep_no_view(
    store: BoardStore, cluster_url: str
) -> None:
    """A dated period whose keys have expired (its end plus the board's retention) or that starts
    after any write could reach it is empty by construction: its top is answered empty without a
    cluster read, and the top cache keeps no view of it (anonymous callers asking for every day of
    the calendar would otherwise fill it with views its refresher re-reads every second)."""
    name = board_name("empty-periods")
    board, _ = await store.create(
        BoardConfig.from_dict(name, {"periods": ["total", "daily"], "retention_days": {"daily": 3}})
    )
    now = times.now_ms()
    day = 86_400_000
    await board.submit([Score("p", 7, "m1", now)])
    try:
        past = [f"daily:{d}" for d in ("2020-01-01", "2026-01-01", times.format_ms(now - 6 * day)[:10])]
        future = [f"daily:{d}" for d in ("2099-12-31", times.format_ms(now + 3 * day)[:10])]
        for period in past + future:
            assert board.holds_nothing(board.resolve(period).period, now), period
        for period in ("total", "daily", f"daily:{times.format_ms(now - 2 * day)[:10]}"):
            assert not board.holds_nothing(board.resolve(period).period, now), period
        async with running(cluster_url) as (app, client):
            tops = service_of(app).tops
            for period in past + future:
                r = await client.get(f"/v1/boards/{name}/top", params={"period": period})
                assert r.status_code == 200 and r.json()["entries"] == [], (period, r.text)
            assert len(tops) == 0
            today = f"daily:{times.format_ms(now)[:10]}"
            r = await client.get(f"/v1/boards/{name}/top", params={"period": today})
            assert [(e["player_id"], e["points"]) for e in r.json()["entries"]] == [("p", 7)]
            assert len(tops) == 1
    finally:
        await store.delete(name)


async def test_the_kept_tops_and_histograms_hold_at_most_their_budgets(
    store: BoardStore, cluster_url: str
) -> None:
    """Anonymous callers choose the views kept and refreshed every second or five: each board,
    period and region they name, each at the largest limit asked. The top cache keeps at most
    SHARDLB_TOP_CACHE_ROWS rows and the rank estimates at most SHARDLB_HISTOGRAM_CACHE_SAMPLES
    samples in all, the least recently read going first; the answers stay whole and exact."""
    name = board_name("cache-budget")
    board, _ = await store.create(
        BoardConfig.from_dict(
            name, {"periods": ["total", "daily", "weekly", "monthly"], "sharding": {"shards": 3}}
        )
    )
    now = times.now_ms()
    await board.submit([Score(f"p{i:03d}", i, f"m{i}", now) for i in range(150)])
    periods = ("total", "daily", "weekly", "monthly")
    try:
        budgets = {"top_cache_rows": 250, "histogram_samples": 8, "histogram_cache_samples": 60}
        async with running(cluster_url, read_rate=0, **budgets) as (app, client):
            svc = service_of(app)
            for period in periods:
                r = await client.get(f"/v1/boards/{name}/top", params={"period": period, "limit": 120})
                assert r.status_code == 200 and len(r.json()["entries"]) == 120, r.text
                assert r.json()["entries"][0]["player_id"] == "p149"
                r = await client.get(
                    f"/v1/boards/{name}/players/p010", params={"period": period, "estimate": "true"}
                )
                assert r.status_code == 200 and r.json()["players"] == 150, r.text
                assert abs(r.json()["rank"] - 140) <= r.json()["rank_error"]
            assert 0 < svc.tops.rows <= 250  # four views of 120 rows would be 480
            assert 0 < svc.histograms.kept_samples <= 60  # four views of 3 shards' 8 samples or so
    finally:
        await store.delete(name)


async def test_concurrent_board_lists_share_one_registry_read(store: BoardStore, cluster_url: str) -> None:
    """GET /v1/boards is public and reads the whole registry: requests that arrive while one such
    read is under way wait for it and share its answer, so a flood of them costs one read at a time
    and the read lane (shared with reads of boards not cached) stays free between them."""
    name = board_name("listed")
    await store.create(BoardConfig.from_dict(name, {}))
    try:
        async with running(cluster_url, read_rate=0) as (app, client):
            boards = service_of(app).boards
            real, calls = boards.store.records, [0]

            async def counted() -> tuple[Any, dict[str, Any]]:
                calls[0] += 1
                return await real()

            boards.store.records = counted  # type: ignore[method-assign]
            answers = await asyncio.gather(*(client.get("/v1/boards") for _ in range(40)))
            assert all(r.status_code == 200 for r in answers)
            assert all(name in {b["board"] for b in r.json()["boards"]} for r in answers)
            assert 1 <= calls[0] <= 10, calls[0]
    finally:
        await store.delete(name)


async def test_a_binary_key_is_named_as_text_in_every_body(
    store: BoardStore, cluster_url: str, postgres_url: str
) -> None:
    """router/README.md: a MessagePack map key sent as bytes is named as text in the error's field.
    Only the board PUT did so; the others named it `b'scores'`, `scores[0].b'points'`... And keys
    of the maps inside a body (a board's retention days and sharding, a reward tier) were named
    `retention_days.b'daily'`, `sharding.b'shards'`, `rewards[0].b'rank'`, in the message too."""
    name = board_name("binkey")
    await store.create(BoardConfig.from_dict(name, {}))
    as_msgpack = {"Content-Type": "application/msgpack"}
    day = times.format_ms(times.now_ms() - 3 * 86_400_000)[:10]
    settle = f"/v1/boards/{name}/periods/daily:{day}:settle"
    posts = [
        (f"/v1/boards/{name}/scores", {b"scores": []}, AS_WRITER, "scores"),
        (f"/v1/boards/{name}/scores", {"scores": [{b"points": 1}]}, AS_WRITER, "scores[0].points"),
        (f"/v1/boards/{name}/players:query", {b"player_ids": []}, AS_WRITER, "player_ids"),
        ("/v1/players/p1:ban", {b"scope": "all"}, AS_ADMIN, "scope"),
        (f"/v1/admin/boards/{name}/reshard", {b"shards": 4}, AS_ADMIN, "shards"),
        (settle, {b"top_n": 1}, AS_ADMIN, "top_n"),
        ("/v1/settlements/nobody/awards:ack", {b"award_ids": []}, AS_ADMIN, "award_ids"),
        (settle, {"settlement_id": "s", "rewards": [{b"rank": 1}]}, AS_ADMIN, "rewards[0].rank"),
    ]
    puts = [
        ({"retention_days": {b"daily": 1}}, "retention_days.daily"),
        ({"sharding": {b"shards": 1}}, "sharding.shards"),
    ]
    calls = [("POST", *call) for call in posts]
    calls += [("PUT", f"/v1/boards/{board_name()}", body, AS_ADMIN, field) for body, field in puts]
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        try:
            for method, path, body, key, field in calls:
                packed = msgpack.packb(body, use_bin_type=True)
                r = await client.request(method, path, content=packed, headers={**key, **as_msgpack})
                assert r.status_code == 422 and r.json()["error"]["field"] == field, (path, r.text)
                assert "b'" not in r.json()["error"]["message"], r.text
        finally:
            await store.delete(name)


async def test_what_a_client_sent_is_echoed_cut_short(store: BoardStore, cluster_url: str) -> None:
    """An unknown field's name came back whole in both `message` and `field` (and in the log line
    of every 4xx): a 92 KB anonymous request drew a 184 KB answer and twice its size in logs."""
    name = board_name("echo")
    await store.create(BoardConfig.from_dict(name, {}))
    long = "k" * 90_000
    async with running(cluster_url) as (_, client):
        try:
            r = await client.post(f"/v1/boards/{name}/players:query", json={long: 1, "player_ids": []})
            error = r.json()["error"]
            assert (r.status_code, error["code"]) == (422, "unknown_field")
            assert len(r.content) < 2_000
            assert error["field"].startswith("kkkk") and len(error["field"]) <= 200
        finally:
            await store.delete(name)


# Values MessagePack carries that JSON cannot (schemathesis sends JSON only): NaN and infinity,
# timestamps, extension types, binaries, the ends of its integers.
PACKED_ODDITIES = [
    float("nan"),
    float("inf"),
    msgpack.Timestamp(2**40, 0),
    msgpack.ExtType(5, b"x"),
    b"p",
    2**64 - 1,
    -(2**63),
    True,
    [{}],
]


async def test_messagepack_values_json_cannot_carry_are_4xx_and_write_nothing(
    store: BoardStore, cluster_url: str
) -> None:
    """Each of them in each field of a score (on a region board, where no field is ignored) and of a
    board's settings: a 4xx with the error body, and no score or board written. (An audit's sweep
    that found none reaching a 500; kept so that none does.)"""
    name = board_name("packed")
    await store.create(BoardConfig.from_dict(name, {"sharding": {"strategy": "region", "regions": ["eu"]}}))
    as_msgpack = {"Content-Type": "application/msgpack"}
    score = {"player_id": "p", "points": 1, "match_id": "m", "achieved_at": times.now_ms(), "region": "eu"}
    settings = ("mode", "periods", "timezone", "retention_days", "points_max", "epoch", "sharding")
    created = []
    async with running(cluster_url) as (_, client):
        try:
            for value in PACKED_ODDITIES:
                for field in score:
                    body = msgpack.packb({"scores": [{**score, field: value}]}, use_bin_type=True)
                    r = await client.post(
                        f"/v1/boards/{name}/scores", content=body, headers={**AS_WRITER, **as_msgpack}
                    )
                    error = r.json()["error"]
                    assert 400 <= r.status_code < 500 and error["field"] is not None, (field, value, r.text)
                for field in settings:
                    created.append(board_name("packed-put"))
                    body = msgpack.packb({field: value}, use_bin_type=True)
                    r = await client.put(
                        f"/v1/boards/{created[-1]}", content=body, headers={**AS_ADMIN, **as_msgpack}
                    )
                    assert 400 <= r.status_code < 500 and "error" in r.json(), (field, value, r.text)
            assert (await client.get(f"/v1/boards/{name}")).json()["players"]["total"] == 0
            listed = {b["board"] for b in (await client.get("/v1/boards")).json()["boards"]}
            assert not listed & set(created)
        finally:
            await store.delete(name)
