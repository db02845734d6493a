"""Settlement (issue 12, items 2-3) against the suite's cluster and a real PostgreSQL: the awards
follow the reference board's final order, an id pays once, the bad requests are refused before
anything is paid, a drifting Redis board stops the settlement unless forced, and a `shardlb settle`
process killed by SIGKILL after each step and run again ends with exactly one award per winner."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread
from typing import Any

import psycopg
import pytest

from shardlb import keys, moderation, periods, settlement_delivery, times
from shardlb.archive import Archiver, connect_db
from shardlb.board import Board, Score
from shardlb.cli import main
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.errors import (
    ArchiveBehind,
    BoardClosed,
    BoardNotFound,
    InvalidInput,
    SettlementConflict,
    SettlementNotFound,
)
from shardlb.rebuild import Rebuilder
from shardlb.reconcile import reconcile
from shardlb.settlement import STEPS, Request, Settler, archive_season, ensure_schema, period_bounds
from shardlb.settlement_history import player_history
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_rebuild import OnlyStore, own_archive

pytestmark = pytest.mark.cluster

TABLE = [
    {"rank": 1, "reward": "gold"},
    {"ranks": [2, 5], "reward": "silver"},
    {"top_percent": 20, "reward": "bronze"},
]


def day_ago(days: int) -> str:
    """The API name of the UTC day ``days`` ago (closed for a day or more when days >= 2)."""
    return "daily:" + (datetime.now(UTC).date() - timedelta(days=days)).isoformat()


async def written(
    board: Board,
    period: str,
    seed: str,
    players: int = 40,
    results: int = 120,
    values: list[int] | None = None,
    ref: ReferenceBoard | None = None,
) -> ReferenceBoard:
    """Random results achieved inside ``period`` (with retries of earlier ones), fed to the board
    and to the reference in the order they were answered, sent while the period was open (the
    writes' clock is the period's last millisecond, or now for the current one). Points from 0 to
    49, or drawn from ``values``. Given ``ref``, it is fed (results written before)."""
    rng = random.Random(seed)
    ref = ReferenceBoard(board.config) if ref is None else ref
    start, end = period_bounds(board, board.resolve(period).period)
    end = min(end, times.now_ms())
    sent: list[Score] = []
    for batch_no in range(results // 30):
        batch = []
        for n in range(30):
            if sent and rng.random() < 0.2:
                batch.append(rng.choice(sent))
                continue
            at = rng.randrange(start, end, 1000)
            points = rng.choice(values) if values else rng.randrange(0, 50)
            batch.append(Score(f"p{rng.randrange(players):03d}", points, f"{seed}-m{batch_no}-{n}", at))
            sent.append(batch[-1])
        await board.submit(batch, now_ms=end - 1)
        ref.submit(batch, now_ms=end - 1)
    return ref


async def drain(raw: Any, store: BoardStore, postgres_url: str, only: set[str] | None = None) -> None:
    """Archive rounds until one finds nothing, over every board of ``store``'s registry or the boards
    named ``only`` (``OnlyStore``): not those other modules left on the worker's cluster."""
    if only is not None:
        store = OnlyStore(store.client, store.scripts, only)
    a = Archiver(raw, store, await connect_db(postgres_url), "settle-tests", claim_idle_s=0)
    try:
        await a.refresh()
        while await a.round():
            pass
    finally:
        await a.db.close()


@pytest.fixture
async def db(postgres_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    conn = await psycopg.AsyncConnection.connect(postgres_url, autocommit=True)
    yield conn
    await conn.close()


async def new_board(store: BoardStore, name: str, mode: str = "best", **settings: Any) -> Board:
    # The writes' clock is set back into closed periods, days ago: an incr board's dedup records
    # then expire a window after that clock, so the window is the longest one, 30 days.
    body = {"mode": mode, "periods": ["daily"], "retention_days": {"daily": 30}, "sharding": {"shards": 3},
            "dedup_window_s": 30 * 86_400}  # fmt: skip
    board, _ = await store.create(BoardConfig.from_dict(name, {**body, **settings}))
    return board


async def awards_of(db: psycopg.AsyncConnection[Any], settlement_id: str) -> list[tuple[int, str, str]]:
    cur = await db.execute(
        "SELECT rank, player_id, reward FROM settlement_awards WHERE settlement_id = %s ORDER BY rank",
        (settlement_id,),
    )
    return [tuple(row) for row in await cur.fetchall()]  # type: ignore[misc]


def expected_awards(
    ref: ReferenceBoard, period: str, board: Board, rule: str = "cut"
) -> list[tuple[int, str, str]]:
    from shardlb.settlement_rewards import assign, parse

    name = board.resolve(period).period
    order = ref.order(name)
    return [
        (a.rank, order[a.rank - 1][1], a.reward) for a in assign(parse(TABLE), [o[2] for o in order], rule)
    ]


@pytest.mark.parametrize("mode", ["best", "incr", "set"])
async def test_awards_follow_the_reference_order(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any], mode: str
) -> None:
    board = await new_board(store, f"settle-ref-{mode}", mode)
    period = day_ago(2)
    try:
        ref = await written(board, period, f"ref/{mode}")
        await written(board, day_ago(0), f"today/{mode}")  # another period: not part of it
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        result = await Settler(rebuilder).settle(
            board, period, Request.of({"settlement_id": f"ref-{mode}", "rewards": TABLE, "top_n": 7})
        )
        want = expected_awards(ref, period, board)
        assert want and await awards_of(db, f"ref-{mode}") == want
        name = board.resolve(period).period
        assert result["players"] == len(ref.order(name))
        assert result["check"]["drifting"] == [] and result["forced"] is False
        cur = await db.execute(
            "SELECT rank, player_id, points FROM settlement_snapshots WHERE settlement_id = %s ORDER BY rank",
            (f"ref-{mode}",),
        )
        kept = await cur.fetchall()
        order = ref.order(name)
        ranks = sorted({*range(1, 8), *(r for r, _, _ in want)})
        assert [tuple(k) for k in kept] == [(r, order[r - 1][1], order[r - 1][2]) for r in ranks]
    finally:
        await store.delete(board.config.id)


@pytest.mark.parametrize("tiebreak", ["earliest", "latest"])
async def test_an_incr_period_with_results_of_no_points_settles_in_the_boards_order(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any], tiebreak: str
) -> None:
    """Sums that tie often, and many 0-point results: PostgreSQL's order (the latest time that
    scored, the earliest for a player of 0 points) is the board's, so the check finds no drift and
    the snapshot keeps each player's time as the reference has it."""
    board = await new_board(store, f"settle-zeros-{tiebreak}", "incr", tiebreak=tiebreak)
    period = day_ago(2)
    sid = f"zeros-{tiebreak}"
    try:
        ref = await written(board, period, sid, players=30, results=150, values=[0, 0, 0, 5, 10])
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        request = Request.of({"settlement_id": sid, "rewards": TABLE, "top_n": 30})
        result = await Settler(rebuilder).settle(board, period, request)
        assert result["check"]["drifting"] == [] and result["forced"] is False
        assert await awards_of(db, sid) == expected_awards(ref, period, board)
        cur = await db.execute(
            "SELECT player_id, points, achieved_ms FROM settlement_snapshots WHERE settlement_id = %s "
            "ORDER BY rank",
            (sid,),
        )
        order = ref.order(board.resolve(period).period)
        assert [tuple(k) for k in await cur.fetchall()] == [
            (p, points, ref.codec.units_to_ms(units)) for _, p, points, units in order
        ]
    finally:
        await store.delete(board.config.id)


async def test_an_id_pays_once_and_names_one_settlement(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any]
) -> None:
    board = await new_board(store, "settle-once")
    period = day_ago(3)
    try:
        await written(board, period, "once")
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        settler = Settler(rebuilder)
        request = Request.of({"settlement_id": "once-1", "rewards": TABLE})
        first = await settler.settle(board, period, request)
        paid = await awards_of(db, "once-1")
        name = board.resolve(period).period
        assert await board.frozen(name)  # a write from a clock set back into the period is kept out
        start, _ = period_bounds(board, name)
        [late] = await board.submit([Score("late", 49, "once-late", start + 1000)], now_ms=start + 2000)
        assert late.closed == (period,) and "late" not in {
            e.player_id for e in await board.top(100, board.resolve(period))
        }
        assert await settler.settle(board, period, request) == first
        assert await awards_of(db, "once-1") == paid
        other_table = Request.of({"settlement_id": "once-1", "rewards": TABLE[:1]})
        with pytest.raises(SettlementConflict) as e:
            await settler.settle(board, period, other_table)
        assert e.value.code == "settlement_conflict"
        with pytest.raises(SettlementConflict):  # the same id for another period
            await settler.settle(board, day_ago(4), request)
        with pytest.raises(SettlementConflict) as e:  # another id for a settled period
            await settler.settle(board, period, Request.of({"settlement_id": "once-2", "rewards": TABLE}))
        assert e.value.code == "period_settled"
        assert await awards_of(db, "once-1") == paid and await awards_of(db, "once-2") == []
    finally:
        await store.delete(board.config.id)


async def test_bad_requests_pay_nothing(store: BoardStore, rebuilder: Rebuilder) -> None:
    board = await new_board(store, "settle-bad")
    settler = Settler(rebuilder)
    request = Request.of({"settlement_id": "bad-1", "rewards": TABLE})
    try:
        with pytest.raises(SettlementConflict) as e:
            await settler.settle(board, day_ago(0), request)
        assert e.value.code == "period_open"
        for period in ("total", "daily:2026-02-30", "weekly:2026-W01", "moon"):
            with pytest.raises(InvalidInput):
                await settler.settle(board, period, request)
        for body in (
            {"settlement_id": "x", "rewards": {"1": "gold"}},
            {"settlement_id": "no spaces", "rewards": TABLE},
            {"settlement_id": "x", "rewards": TABLE, "top_n": -1},
            {"rewards": TABLE},
            {"settlement_id": "x", "rewards": TABLE, "webhook_url": "ftp://x"},
        ):
            with pytest.raises(InvalidInput):
                Request.of(body)
        with pytest.raises(SettlementNotFound):
            await settlement_delivery.get(rebuilder.db, "bad-1")
    finally:
        await store.delete(board.config.id)
    with pytest.raises(BoardNotFound):
        await store.get("settle-bad")


async def test_a_period_that_ends_by_the_board_epoch_is_invalid(
    store: BoardStore, rebuilder: Rebuilder
) -> None:
    """No result can be achieved before the epoch, so such a period was settled with 0 players and its
    settlement took the period for good. The boundary is the period's end in the board's time zone:
    New York's 2025-12-31 ends at 05:00Z on the epoch's day and holds its first five hours."""
    board = await new_board(
        store,
        "settle-epoch",
        periods=["daily", "monthly"],
        retention_days={"daily": 30, "monthly": 400},
        timezone="America/New_York",
        epoch="2026-01-01T00:00:00Z",
    )
    epoch = board.config.epoch_ms
    settler = Settler(rebuilder)
    request = Request.of({"settlement_id": "epoch-1", "rewards": TABLE})
    await ensure_schema(rebuilder.db)  # for the lookup below, when no settlement ran before
    try:
        for period in ("daily:1900-01-01", "daily:2025-12-30", "monthly:1969-12", "monthly:2025-11"):
            with pytest.raises(InvalidInput) as e:
                await settler.settle(board, period, request)
            assert (e.value.code, e.value.field) == ("invalid_period", "period"), period
        for period in ("daily:2025-12-31", "monthly:2025-12"):  # open at the epoch: may hold results
            with pytest.raises(SettlementConflict) as conflict:
                await settler.settle(board, period, request, now_ms=epoch)
            assert conflict.value.code == "period_open"
        with pytest.raises(SettlementNotFound):
            await settlement_delivery.get(rebuilder.db, "epoch-1")
    finally:
        await store.delete(board.config.id)


async def test_a_drifting_board_stops_the_settlement_unless_forced(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any]
) -> None:
    board = await new_board(store, "settle-drift")
    period = day_ago(2)
    name = board.resolve(period).period
    try:
        ref = await written(board, period, "drift")
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        await raw.zadd(keys.period_key(board.prefixes[1], name), {"intruder": 2**40})  # not in PostgreSQL
        settler = Settler(rebuilder)
        with pytest.raises(SettlementConflict) as e:
            await settler.settle(board, period, Request.of({"settlement_id": "drift-1", "rewards": TABLE}))
        assert e.value.code == "settlement_mismatch"
        assert await awards_of(db, "drift-1") == []
        stored = await settlement_delivery.get(db, "drift-1")
        assert stored["state"] == "mismatch" and [d["shard"] for d in stored["report"]["drifting"]] == [1]
        forced = Request.of({"settlement_id": "drift-1", "rewards": TABLE, "force": True})
        result = await settler.settle(board, period, forced)
        assert result["forced"] is True
        assert await awards_of(db, "drift-1") == expected_awards(ref, period, board)  # PostgreSQL's order
    finally:
        await store.delete(board.config.id)


async def test_a_period_past_its_retention_says_why_it_cannot_be_checked(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any]
) -> None:
    """Settled after its retention, a period's Redis keys have expired: the check finds nothing to
    compare PostgreSQL's order with. The stop says so, and what to do (force pays PostgreSQL's
    order), rather than only that the shards differ."""
    board = await new_board(store, "settle-expired", retention_days={"daily": 3})
    period = day_ago(2)
    name = board.resolve(period).period
    try:
        ref = await written(board, period, "expired")
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        for prefix in board.prefixes:  # what Redis does at the period's expiry (end + 3 days)
            await raw.delete(keys.period_key(prefix, name))
        later = period_bounds(board, name)[1] + 4 * 86_400_000
        settler = Settler(rebuilder)
        request = {"settlement_id": "expired-1", "rewards": TABLE}
        with pytest.raises(SettlementConflict) as e:
            await settler.settle(board, period, Request.of(request), now_ms=later)
        assert e.value.code == "settlement_mismatch"
        assert "retention" in str(e.value) and "expired" in str(e.value) and "force" in str(e.value)
        stored = await settlement_delivery.get(db, "expired-1")
        assert stored["state"] == "mismatch" and stored["report"]["redis_expired"] is True
        assert await awards_of(db, "expired-1") == []
        result = await settler.settle(board, period, Request.of({**request, "force": True}), now_ms=later)
        assert result["forced"] is True
        assert await awards_of(db, "expired-1") == expected_awards(ref, period, board)
    finally:
        await store.delete(board.config.id)


async def test_a_settlement_waits_for_the_archiver(store: BoardStore, raw: Any, rebuilder: Rebuilder) -> None:
    board = await new_board(store, "settle-behind")
    period = day_ago(2)
    try:
        await written(board, period, "behind")
        with pytest.raises(ArchiveBehind):
            await Settler(rebuilder, drain_wait_s=0.3).settle(
                board, period, Request.of({"settlement_id": "behind-1", "rewards": TABLE})
            )
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        result = await Settler(rebuilder).settle(
            board, period, Request.of({"settlement_id": "behind-1", "rewards": TABLE})
        )
        assert result["state"] == "settled"
    finally:
        await store.delete(board.config.id)


async def test_all_pays_every_tie_at_a_boundary(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any]
) -> None:
    period = day_ago(2)
    ties = {"a": 90, "b": 80, "c": 80, "d": 80, "e": 70}
    got = {}
    for rule in ("cut", "all"):
        board = await new_board(store, f"settle-ties-{rule}", tie_awards=rule)
        start, _ = period_bounds(board, board.resolve(period).period)
        try:
            sent = [Score(p, v, "m1", start + 1000 * i) for i, (p, v) in enumerate(ties.items())]
            await board.submit(sent, now_ms=start + 10_000)  # while the period was open
            await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
            table = [{"rank": 1, "reward": "gold"}, {"ranks": [2, 3], "reward": "silver"}]
            await Settler(rebuilder).settle(
                board, period, Request.of({"settlement_id": f"ties-{rule}", "rewards": table})
            )
            got[rule] = [(p, r) for _, p, r in await awards_of(db, f"ties-{rule}")]
        finally:
            await store.delete(board.config.id)
    assert got["cut"] == [("a", "gold"), ("b", "silver"), ("c", "silver")]  # earliest first: b, c in, d out
    assert got["all"] == [("a", "gold"), ("b", "silver"), ("c", "silver"), ("d", "silver")]


async def test_awards_page_by_cursor_and_acknowledged_ones_are_not_offered_again(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any]
) -> None:
    board = await new_board(store, "settle-pages")
    period = day_ago(2)
    try:
        await written(board, period, "pages")
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        await Settler(rebuilder).settle(
            board, period, Request.of({"settlement_id": "pages-1", "rewards": TABLE})
        )
        every = await awards_of(db, "pages-1")
        seen, after = [], None
        while True:
            page = await settlement_delivery.awards(db, "pages-1", after, 3)
            seen += page["awards"]
            after = page["next"]
            if after is None:
                break
        assert [(a["rank"], a["player_id"], a["reward"]) for a in seen] == every
        paid = [a["award_id"] for a in seen[:4]]
        assert (await settlement_delivery.ack(db, "pages-1", paid))["acknowledged"] == 4
        assert (await settlement_delivery.ack(db, "pages-1", paid)) == {
            "settlement_id": "pages-1",
            "acknowledged": 0,
            "already": 4,
        }
        left = await settlement_delivery.awards(db, "pages-1", None, 1000)
        assert [a["award_id"] for a in left["awards"]] == [a["award_id"] for a in seen[4:]]
        assert (await settlement_delivery.get(db, "pages-1"))["acknowledged"] == 4
        for bad in (["999999999"], [1], "1", []):
            with pytest.raises(InvalidInput):
                await settlement_delivery.ack(db, "pages-1", bad)
        with pytest.raises(InvalidInput):
            await settlement_delivery.awards(db, "pages-1", "x", 10)
    finally:
        await store.delete(board.config.id)


@pytest.mark.slow
async def test_killed_after_each_step_and_run_again_pays_each_winner_once(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    db: psycopg.AsyncConnection[Any],
    cluster_url: str,
    postgres_url: str,
) -> None:
    """`shardlb settle` dies by SIGKILL right after each step (inside the storing transaction for
    `snapshot` and `awards`); the same command run again finishes, and a third run changes nothing."""
    board = await new_board(store, "settle-kill")
    days = {step: day_ago(2 + i) for i, step in enumerate(STEPS)}
    try:
        refs = {step: await written(board, period, f"kill/{step}") for step, period in days.items()}
        await drain(raw, store, postgres_url, {board.config.id})
        for step, period in days.items():
            argv = [
                sys.executable,
                "-m",
                "shardlb",
                "settle",
                board.config.id,
                period,
                "--id",
                f"kill-{step}",
                "--rewards",
                json.dumps(TABLE),
                "--redis",
                cluster_url,
                "--postgres",
                postgres_url,
            ]
            env = {**os.environ, "SHARDLB_SETTLE_KILL_AFTER": step}
            killed = await asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True, timeout=120)
            assert killed.returncode == -9, killed.stderr.decode()
            again = await asyncio.to_thread(subprocess.run, argv, capture_output=True, timeout=120)
            assert again.returncode == 0, again.stderr.decode()
            want = expected_awards(refs[step], period, board)
            assert want and await awards_of(db, f"kill-{step}") == want, step
            third = await asyncio.to_thread(subprocess.run, argv, capture_output=True, timeout=120)
            assert json.loads(third.stdout) == json.loads(again.stdout)
            assert await awards_of(db, f"kill-{step}") == want
    finally:
        await store.delete(board.config.id)


class Receiver:
    """A webhook receiver on 127.0.0.1 that fails each award's first POST, then takes it; it
    checks the signature and counts POSTs per idempotency key."""

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.posts: dict[str, int] = {}
        self.bodies: dict[str, dict[str, Any]] = {}
        self.bad_signatures = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                want = "sha256=" + hmac.new(owner.secret.encode(), body, hashlib.sha256).hexdigest()
                if not hmac.compare_digest(want, self.headers.get("x-shardlb-signature", "")):
                    owner.bad_signatures += 1
                key = self.headers["idempotency-key"]
                owner.posts[key] = owner.posts.get(key, 0) + 1
                owner.bodies[key] = json.loads(body)
                self.send_response(503 if owner.posts[key] == 1 else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/awards"
        self.thread = Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


async def test_the_webhook_delivers_every_award_signed_and_retried(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any]
) -> None:
    board = await new_board(store, "settle-hook")
    period = day_ago(2)
    try:
        await written(board, period, "hook")
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        with Receiver("s3cret") as receiver:
            body = {"settlement_id": "hook-1", "rewards": TABLE, "webhook_url": receiver.url}
            await Settler(rebuilder).settle(board, period, Request.of(body))
            counts = await settlement_delivery.deliver_until_done(
                db, "s3cret", "hook-1", deadline_s=60, base_s=0.05
            )
        ids = {
            str(row[0])
            for row in await (
                await db.execute("SELECT award_id FROM settlement_awards WHERE settlement_id = 'hook-1'")
            ).fetchall()
        }
        assert counts == {"delivered": len(ids), "pending": 0, "failed": 0}
        assert set(receiver.posts) == ids and set(receiver.posts.values()) == {2}  # failed once, then taken
        assert receiver.bad_signatures == 0
        assert {b["award_id"] for b in receiver.bodies.values()} == ids
    finally:
        await store.delete(board.config.id)


async def test_a_removed_player_is_neither_ranked_nor_rewarded(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any]
) -> None:
    board = await new_board(store, "settle-removed")
    period = day_ago(2)
    name = board.resolve(period).period
    try:
        ref = await written(board, period, "removed")
        cheater = ref.order(name)[0][1]
        await moderation.remove(board, [cheater])
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        result = await Settler(rebuilder).settle(
            board, period, Request.of({"settlement_id": "removed-1", "rewards": TABLE})
        )
        del ref.boards[name][cheater]
        assert result["check"]["drifting"] == [] and result["players"] == len(ref.order(name))
        paid = await awards_of(db, "removed-1")
        assert cheater not in {p for _, p, _ in paid}
        assert paid == expected_awards(ref, period, board)
    finally:
        await store.delete(board.config.id)


async def test_a_season_archive_closes_the_total_so_no_post_is_lost(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any]
) -> None:
    """Posts go on while the board is archived at its season's end (the archiver running): each is
    either refused as closed, with nothing written, or paid from the settled total; the archive needs
    no force. Before the total could be closed, the late posts made Redis differ from PostgreSQL."""
    board = await new_board(store, "season-close")
    only = OnlyStore(store.client, store.scripts, {board.config.id})
    archiver = Archiver(raw, only, await connect_db(rebuilder.db.info.dsn), "season-close", claim_idle_s=0)
    stop, started = asyncio.Event(), asyncio.Event()
    accepted: list[str] = []
    refused: list[str] = []

    async def post() -> None:
        n = 0
        while not stop.is_set():
            player = f"late{n:05d}"
            try:
                await board.submit([Score(player, 10 + n % 7, f"late-{n}")])
            except BoardClosed:
                refused.append(player)
            else:
                accepted.append(player)
            n += 1
            if n == 30:
                started.set()
            await asyncio.sleep(0)

    await archiver.refresh()
    tasks = [asyncio.create_task(archiver.run(stop, idle_s=0.05)), asyncio.create_task(post())]
    try:
        await started.wait()
        request = Request.of({"settlement_id": "season-close-1", "rewards": TABLE, "top_n": 100_000})
        result = await Settler(rebuilder).settle(board, "total", request, season=True)
        await asyncio.sleep(0.2)  # posts made after the settlement: refused as well
        stop.set()
        await asyncio.gather(*tasks)
        assert refused and result["forced"] is False and result["players"] == len(accepted)
        cur = await db.execute(
            "SELECT player_id FROM settlement_snapshots WHERE settlement_id = %s", ("season-close-1",)
        )
        assert sorted(row[0] for row in await cur.fetchall()) == sorted(accepted)
        cur = await db.execute(
            "SELECT DISTINCT player_id FROM match_results WHERE board = %s AND incarnation = %s",
            (board.config.id, board.incarnation),
        )
        assert sorted(row[0] for row in await cur.fetchall()) == sorted(accepted)  # nothing refused was kept
        held = [await raw.zcard(keys.period_key(prefix, "total")) for prefix in board.prefixes]
        assert sum(held) == len(accepted)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await archiver.db.close()
        await store.delete(board.config.id)


async def test_a_board_whose_season_archive_was_under_way_stays_closed_after_a_total_loss(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """A durability audit's finding: the season archive's close (the total's frozen marker) lived
    in Redis only, and `rebuild --all` after a total loss brought the board back open: posts were
    taken again into a season being paid. The restore now closes every board with a season
    settlement in PostgreSQL."""
    board = await new_board(store, "season-loss")
    async with own_archive(postgres_url) as url:
        only = OnlyStore(store.client, store.scripts, {board.config.id})
        a = Archiver(raw, only, await connect_db(url), "season-loss", claim_idle_s=0)
        db = await psycopg.AsyncConnection.connect(url, autocommit=True)
        try:
            await a.refresh()
            await board.submit([Score("p1", 10, "m1", times.now_ms() - 60_000)])
            while await a.round():
                pass

            def crash(step: str) -> None:
                if step == "freeze":
                    raise RuntimeError("the archive died after closing the board")

            request = Request.of({"settlement_id": "season-loss-1", "rewards": TABLE})
            with pytest.raises(RuntimeError):
                await Settler(Rebuilder(raw, Scripts.register(raw).rebuild, db), crash).settle(
                    board, "total", request, season=True
                )
            with pytest.raises(BoardClosed):
                await board.submit([Score("p2", 20, "m2")])
            await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", url]
            assert await asyncio.to_thread(main, command) == 0
            rebuilt = await store.get(board.config.id)
            assert [e.player_id for e in await rebuilt.top(10)] == ["p1"]
            with pytest.raises(BoardClosed):
                await rebuilt.submit([Score("p2", 20, "m2")])
            assert await rebuilt.closed()
        finally:
            await db.close()
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(board.config.id)


async def test_a_season_archive_deletes_the_board_it_settled_not_one_created_again(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """A season archive settles the board's total, then deletes the board: by its id, whichever
    board held it then. Deleted and created again in between (the next season's board, made by
    another admin or process), the new board was deleted with all its results. The archive now
    deletes the incarnation it settled only; a board created again is left alone."""
    name = "season-own-board"
    board = await new_board(store, name)

    async def created_again() -> None:  # another process: its own connection and event loop
        client = connect(cluster_url)
        try:
            other = BoardStore(client, Scripts.register(client))
            await other.delete(name)
            again, _ = await other.create(BoardConfig.from_dict(name, {"periods": ["daily"]}))
            await again.submit([Score("next", 7, "next-m1")])
        finally:
            await client.aclose()

    def at_commit(step: str) -> None:
        if step == "commit":
            other = Thread(target=lambda: asyncio.run(created_again()))
            other.start()
            other.join()

    try:
        await board.submit([Score("p1", 10, "m1", times.now_ms() - 60_000)])
        await drain(raw, store, postgres_url, {board.config.id})
        request = Request.of({"settlement_id": "season-own-1", "rewards": TABLE})
        result = await archive_season(cluster_url, postgres_url, name, request, step=at_commit)
        assert (result["archived"], result["players"]) == (True, 1)
        new = await store.get(name)
        assert new.incarnation != board.incarnation and not await new.closed()
        assert [(e.player_id, e.points) for e in await new.top(10)] == [("next", 7)]
    finally:
        with contextlib.suppress(BoardNotFound):
            await store.delete(name)


@pytest.mark.parametrize("mode", ["best", "incr", "set"])
async def test_a_board_created_again_settles_its_own_results_bans_and_removals(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any], mode: str
) -> None:
    """A board deleted and created again under its id settles the same period as a new board: the
    old incarnation's rows (its results under the same match ids, a late retry's hold), its board
    bans and its removals count for nothing there; a ban stored without an incarnation (before
    2026-12-05) still holds on the board of its id. Awards as the reference of the new board says."""
    name = f"settle-again-{mode}"
    board = await new_board(store, name, mode)
    period = day_ago(2)
    day = board.resolve(period).period
    start, end = period_bounds(board, day)
    players = [f"p{i:02d}" for i in range(12)]
    banned_before, legacy, removed_before = players[1], players[2], players[3]
    try:
        old = [Score(p, 10 + i, f"m-{p}", start + 1000 * (i + 1)) for i, p in enumerate(players)]
        await board.submit(old, now_ms=end - 1)
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        if mode != "incr":  # a late better retry after the day closed: the old day's hold
            await board.submit([Score(players[0], 90, f"m-{players[0]}", start + 1000)])
        await moderation.remove(board, [removed_before])
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        for table, held in (("match_holds", int(mode != "incr")), ("player_removals", 1)):
            sql = f"SELECT count(*) FROM {table} WHERE board = %s AND incarnation = %s"
            cur = await db.execute(sql, (name, board.incarnation))
            assert await cur.fetchone() == (held,)  # the old incarnation's rows are there
        await db.execute(
            "INSERT INTO bans (player_id, board, reason, banned_by, incarnation) VALUES "
            "(%s, %s, 'old', 'ops', %s), (%s, %s, 'legacy', 'ops', NULL)",
            (banned_before, name, board.incarnation, legacy, name),
        )
        await store.delete(name)
        again = await new_board(store, name, mode)
        assert again.incarnation != board.incarnation
        ref = ReferenceBoard(again.config)
        new = [
            Score(p, 50 - 3 * i, f"m-{p}", start + 2000 * (i + 1))
            for i, p in enumerate(players)
            if p != legacy  # refused by the routers: its ban holds on every board of the id
        ]
        await again.submit(new, now_ms=end - 1)
        ref.submit(new, now_ms=end - 1)
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        request = Request.of({"settlement_id": f"again-{mode}", "rewards": TABLE})
        result = await Settler(rebuilder).settle(again, period, request)
        assert result["check"]["drifting"] == [] and result["players"] == len(players) - 1
        paid = await awards_of(db, f"again-{mode}")
        assert paid == expected_awards(ref, period, again)
        winners = {p for _, p, _ in paid}
        assert {banned_before, removed_before} <= winners and legacy not in winners
    finally:
        await db.execute("DELETE FROM bans WHERE board = %s", (name,))
        with contextlib.suppress(BoardNotFound):
            await store.delete(name)


@pytest.mark.parametrize(("mode", "archived_between"), [("best", False), ("best", True), ("set", True)])
async def test_a_late_better_retry_of_a_match_keeps_its_first_score_in_the_closed_period(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    db: psycopg.AsyncConnection[Any],
    mode: str,
    archived_between: bool,
) -> None:
    """A match sent again with a better score after its period closed counts in the total only, so the
    frozen period keeps the first score; the settlement pays that order. Until 2026-12-05 PostgreSQL lost
    the first score (in one archiver batch or across two): the check stopped the settlement for good,
    and a forced one paid the runner-up."""
    sid = f"late-retry-{mode}-{int(archived_between)}"
    board = await new_board(store, f"settle-{sid}", mode)
    period = day_ago(2)
    name = board.resolve(period).period
    start, end = period_bounds(board, name)
    table = [{"rank": 1, "reward": "gold"}]
    try:
        first = [Score("first", 10, "late-m1", start + 1000), Score("second", 5, "late-m2", start + 2000)]
        await board.submit(first, now_ms=end - 1)
        if archived_between:
            await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        [late] = await board.submit([Score("first", 40, "late-m1", start + 1000)])
        assert late.closed == (period,)  # the total took it, the closed period did not
        assert [e.player_id for e in await board.top(10, board.resolve(period))] == ["first", "second"]
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        request = Request.of({"settlement_id": sid, "rewards": table})
        result = await Settler(rebuilder).settle(board, period, request)
        assert result["check"]["drifting"] == [] and result["players"] == 2
        assert await awards_of(db, result["settlement_id"]) == [(1, "first", "gold")]
    finally:
        await store.delete(board.config.id)


async def test_a_player_banned_after_the_check_is_not_paid(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any]
) -> None:
    """A ban committed while the settlement ran, after its order was checked, is found before the
    awards commit: nothing is paid, and the run again leaves the banned player out."""
    board = await new_board(store, "settle-banned-late")
    period = day_ago(2)
    name = board.resolve(period).period
    try:
        ref = await written(board, period, "banned-late")
        cheater = ref.order(name)[0][1]
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        dsn = rebuilder.db.info.dsn

        def ban_at_check(step: str) -> None:  # another session's ban, as the router's (Bans.add)
            if step == "check":
                with psycopg.connect(dsn, autocommit=True) as other:
                    other.execute(
                        "INSERT INTO bans (player_id, board, reason, banned_by) "
                        "VALUES (%s, %s, 'cheat', 'ops')",
                        (cheater, board.config.id),
                    )

        request = Request.of({"settlement_id": "banned-late-1", "rewards": TABLE})
        with pytest.raises(SettlementConflict):
            await Settler(rebuilder, ban_at_check).settle(board, period, request)
        assert await awards_of(db, "banned-late-1") == []
        await moderation.remove(board, [cheater])  # the ban's removal from Redis (router/moderation.py)
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        await Settler(rebuilder).settle(board, period, request)
        del ref.boards[name][cheater]
        assert await awards_of(db, "banned-late-1") == expected_awards(ref, period, board)
    finally:
        await db.execute("DELETE FROM bans WHERE board = %s", (board.config.id,))
        await store.delete(board.config.id)


async def test_a_ban_committing_as_the_awards_are_written_is_not_paid(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any]
) -> None:
    """A ban inserted by another session before the store step looks bans up, and committed only a
    moment later: the settlement waits for it and pays nothing. Until 2026-12-05 the look-up did not
    see the uncommitted ban and the awards committed with the banned winner paid."""
    board = await new_board(store, "settle-banned-racing")
    period = day_ago(2)
    try:
        ref = await written(board, period, "banned-racing")
        cheater = ref.order(board.resolve(period).period)[0][1]
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        other = psycopg.connect(rebuilder.db.info.dsn)  # a transaction of its own, left open
        committing: list[Thread] = []

        def ban_in_flight(step: str) -> None:
            if step == "check":
                other.execute(
                    "INSERT INTO bans (player_id, board, reason, banned_by) VALUES (%s, %s, 'cheat', 'ops')",
                    (cheater, board.config.id),
                )
                committing.append(Thread(target=lambda: (time.sleep(1.0), other.commit())))
                committing[0].start()

        request = Request.of({"settlement_id": "banned-racing-1", "rewards": TABLE})
        try:
            with pytest.raises(SettlementConflict):
                await Settler(rebuilder, ban_in_flight).settle(board, period, request)
        finally:
            for t in committing:
                t.join()
            other.close()
        assert await awards_of(db, "banned-racing-1") == []
    finally:
        await db.execute("DELETE FROM bans WHERE board = %s", (board.config.id,))
        await store.delete(board.config.id)


@pytest.mark.parametrize("mode", ["best", "set"])
async def test_a_rebuild_keeps_the_first_score_of_a_late_retry_in_the_closed_period(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, mode: str
) -> None:
    """The late better retry above, once both applications are archived and trimmed from the journal:
    a reconcile of the closed period finds Redis and PostgreSQL equal, and a rebuild from PostgreSQL
    puts back the score the period holds (the first), not the retry's. Until 2026-12-05 both read the
    match's row only: the reconcile showed drift, the rebuild dropped the first score."""
    board = await new_board(store, f"rebuild-late-retry-{mode}", mode=mode)
    period = day_ago(2)
    start, end = period_bounds(board, board.resolve(period).period)
    try:
        first = [Score("first", 10, "late-m1", start + 1000), Score("second", 5, "late-m2", start + 2000)]
        await board.submit(first, now_ms=end - 1)
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        [late] = await board.submit([Score("first", 40, "late-m1", start + 1000)])
        assert late.closed == (period,)
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        for prefix in board.prefixes:  # archived: the journal holds none of them now
            await raw.xtrim(keys.journal_key(prefix), maxlen=0)
        top = await board.top(10, board.resolve(period))
        assert [(e.player_id, e.points) for e in top] == [("first", 10), ("second", 5)]
        assert not any(c.drift for c in await reconcile(rebuilder, board, period))
        await rebuilder.rebuild(board)
        assert await board.top(10, board.resolve(period)) == top
        assert [(e.player_id, e.points) for e in await board.top(10)] == [("first", 40), ("second", 5)]
    finally:
        await store.delete(board.config.id)


@pytest.mark.parametrize("mode", ["best", "incr", "set"])
async def test_a_removal_that_keeps_some_periods_settles_reconciles_and_rebuilds_as_redis_holds(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any], mode: str
) -> None:
    """A removal retried past the dedup window is made at the first call's time (``since_ms``): the
    player's entries achieved since stay, older ones go, period by period (remove.lua). Here the
    player's day holds a result posted since (kept), the day before an older one (removed), and the
    total both: a best total of before goes, an incr sum and a set board's latest stay. Until
    2026-12-05 the delete entry named the player, so PostgreSQL dropped every earlier row of the
    player on the shard: the settlement of the day stopped with settlement_mismatch, and a reconcile
    showed drift, in every mode."""
    board = await new_board(store, f"settle-kept-{mode}", mode=mode)
    ref = ReferenceBoard(board.config)
    old_day, day = day_ago(3), day_ago(2)
    s1, _ = period_bounds(board, board.resolve(old_day).period)
    s2, e2 = period_bounds(board, board.resolve(day).period)
    at = s2 + 3_600_000  # the removal's first call

    async def submit(scores: list[Score], now_ms: int) -> None:
        await board.submit(scores, now_ms=now_ms)
        ref.submit(scores, now_ms=now_ms)

    try:
        await submit([Score("p", 5, "p-1", s2 + 1_800_000), Score("q", 3, "q-1", s2 + 1000)], at - 1)
        await moderation.remove(board, ["p"], now_ms=at, request="remove/R")
        ref.remove("p", at, "remove/R")
        await submit([Score("p", 8, "p-2", s2 + 3 * 3_600_000)], e2 - 1)  # posted since: stays
        for prefix in board.prefixes:  # the dedup window is over: the removal's records are gone
            await raw.delete(keys.removals_key(prefix))
        ref.removed.clear()
        ref.requests = {"remove/R": (ref.record_units(at), set(), set())}
        # A late result achieved before the removal, sent while its day was open: it goes.
        await submit([Score("p", 20, "p-old", s1 + 3_600_000)], s1 + 7_200_000)
        assert await moderation.remove(board, ["p"], request="remove/R", since_ms=at) == {"p"}
        assert ref.remove("p", request="remove/R")
        names = ["total", board.resolve(day).period, board.resolve(old_day).period]
        for name in names:
            top = await board.top(10, board.resolve(periods.api_name(name)))
            assert [(e.player_id, e.points) for e in top] == [(p, n) for _, p, n, _ in ref.order(name)]
        await ensure_schema(db)
        for name in names:  # the journal's entries, then the archived rows
            assert not any(c.drift for c in await reconcile(rebuilder, board, periods.api_name(name)))
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        for name in names:
            assert not any(c.drift for c in await reconcile(rebuilder, board, periods.api_name(name)))
        # The player's history: each result in the periods that hold it (the total kept, but on best)
        totals = [] if mode == "best" else ["total"]
        history = {h["match_id"]: sorted(h["periods"]) for h in await player_history(db, board, "p", 10)}
        assert history == {"p-1": [], "p-2": sorted([day, *totals]), "p-old": totals}
        table = [{"rank": 1, "reward": "gold"}, {"rank": 2, "reward": "silver"}]
        request = Request.of({"settlement_id": f"kept-{mode}", "rewards": table})
        result = await Settler(rebuilder).settle(board, day, request)
        assert result["check"]["drifting"] == [] and not result["forced"]
        # The reference's order of the day, rewarded by the table
        order = ref.order(names[1])
        expected = [(r["rank"], p, r["reward"]) for (_, p, _, _), r in zip(order, table, strict=True)]
        assert await awards_of(db, f"kept-{mode}") == expected == [(1, "p", "gold"), (2, "q", "silver")]
        tops = {name: await board.top(10, board.resolve(periods.api_name(name))) for name in names}
        await rebuilder.rebuild(board)
        for name in names:
            assert await board.top(10, board.resolve(periods.api_name(name))) == tops[name]
    finally:
        await store.delete(board.config.id)


@pytest.mark.parametrize("batches", [1, 2], ids=["one-batch", "two-batches"])
async def test_a_retry_after_a_removal_that_kept_its_closed_period_settles_reconciles_and_rebuilds_as_redis(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any], batches: int
) -> None:
    """The archiver's merge of one result applied twice (``_merge_retries`` in one batch, the
    upsert's ``_SKIPPED`` across two) starts again from the later application when a removal of the
    player came between them, also one that left some periods whole (a retry at the first call's
    time). Here it kept the day (p-2 achieved since) and took the best total (p-old, before): p-2
    sent again after the day closed goes into the total alone, and the row then skips the day. The
    day still holds p-2's first application through ``match_holds``, which the removal's ``kept``
    lets count: the day settles, reconciles and rebuilds as Redis and the reference hold it."""
    board = await new_board(store, f"settle-kept-retry-{batches}")
    ref = ReferenceBoard(board.config)
    old_day, day = day_ago(3), day_ago(2)
    s1, _ = period_bounds(board, board.resolve(old_day).period)
    s2, e2 = period_bounds(board, board.resolve(day).period)
    at = s2 + 3_600_000  # the removal's first call
    again = Score("p", 8, "p-2", s2 + 3 * 3_600_000)

    async def submit(scores: list[Score], now_ms: int) -> None:
        await board.submit(scores, now_ms=now_ms)
        ref.submit(scores, now_ms=now_ms)

    try:
        await submit([Score("p", 5, "p-1", s2 + 1_800_000), Score("q", 3, "q-1", s2 + 1000)], at - 1)
        await moderation.remove(board, ["p"], now_ms=at, request="remove/R")
        ref.remove("p", at, "remove/R")
        await submit([again], e2 - 1)  # posted since: stays in the day
        for prefix in board.prefixes:  # the dedup window is over: the removal's records are gone
            await raw.delete(keys.removals_key(prefix))
        ref.removed.clear()
        ref.requests = {"remove/R": (ref.record_units(at), set(), set())}
        await submit([Score("p", 20, "p-old", s1 + 3_600_000)], s1 + 7_200_000)  # the best total
        assert await moderation.remove(board, ["p"], request="remove/R", since_ms=at) == {"p"}
        assert ref.remove("p", request="remove/R")
        if batches == 2:
            await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        now = times.now_ms()
        await submit([again], now)  # sent again after the day closed: the total alone
        assert ref.closed == [(day,)]
        names = ["total", board.resolve(day).period, board.resolve(old_day).period]
        for name in names:
            top = await board.top(10, board.resolve(periods.api_name(name)))
            assert [(e.player_id, e.points) for e in top] == [(p, n) for _, p, n, _ in ref.order(name)]
        assert [(p, n) for _, p, n, _ in ref.order(names[0])] == [("p", 8), ("q", 3)]
        assert [(p, n) for _, p, n, _ in ref.order(names[1])] == [("p", 8), ("q", 3)]
        await drain(raw, store, rebuilder.db.info.dsn, {board.config.id})
        await ensure_schema(db)
        cur = await db.execute(
            "SELECT skipped FROM match_results WHERE board = %s AND match_id = 'p-2'", (board.config.id,)
        )
        assert await cur.fetchall() == [([names[1]],)]  # the later application's
        cur = await db.execute(
            "SELECT period FROM match_holds WHERE board = %s AND match_id = 'p-2'", (board.config.id,)
        )
        assert await cur.fetchall() == [(names[1],)]  # the first, for the day
        for name in names:
            assert not any(c.drift for c in await reconcile(rebuilder, board, periods.api_name(name)))
        table = [{"rank": 1, "reward": "gold"}, {"rank": 2, "reward": "silver"}]
        request = Request.of({"settlement_id": f"kept-retry-{batches}", "rewards": table})
        result = await Settler(rebuilder).settle(board, day, request)
        assert result["check"]["drifting"] == [] and not result["forced"]
        assert await awards_of(db, f"kept-retry-{batches}") == [(1, "p", "gold"), (2, "q", "silver")]
        tops = {name: await board.top(10, board.resolve(periods.api_name(name))) for name in names}
        await rebuilder.rebuild(board)
        for name in names:
            assert await board.top(10, board.resolve(periods.api_name(name))) == tops[name]
    finally:
        await store.delete(board.config.id)
