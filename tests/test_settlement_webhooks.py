"""Settlement webhooks (shardlb/settlement_delivery.py) against the suite's cluster, a real PostgreSQL
and a local HTTP receiver: retries spread over hours, a settlement run again sends what failed for
good, two deliverers never post one delivery at once, the first webhook_url is part of the
settlement's identity, nothing is signed with an empty secret, and a malformed URL is refused (or,
stored before that check, is a failed attempt rather than a crash)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router import openapi
from shardlb import settlement_delivery
from shardlb.board import Board, Score
from shardlb.cli import main
from shardlb.errors import InvalidInput, SettlementConflict
from shardlb.rebuild import Rebuilder
from shardlb.settlement import Request, Settler
from shardlb.settlement_delivery import MAX_ATTEMPTS, backoff, deliver, deliver_until_done, delivery_counts
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running
from tests.test_settlement import TABLE, day_ago, drain, new_board, written

SECRET = "s3cret"
FAST = {"base_s": 0.001, "cap_s": 0.002}  # the schedule scaled down: every attempt in a second or so


class Hook:
    """A webhook receiver on 127.0.0.1: answers 200 while ``up`` (else 503), each POST after
    ``delay_s``; counts POSTs and answers per idempotency key, the most of one key in flight at once,
    and bodies whose signature is wrong. Made ``held``, it answers only the keys in ``quick`` until
    ``release`` is set (the others wait, in flight, up to a minute)."""

    def __init__(self, up: bool = True, delay_s: float = 0.0, held: bool = False) -> None:
        self.up = up
        self.delay_s = delay_s
        self.quick: set[str] = set()
        self.release = threading.Event()
        if not held:
            self.release.set()
        self.posts: Counter[str] = Counter()
        self.answered: Counter[str] = Counter()
        self.in_flight: Counter[str] = Counter()
        self.most_at_once = 0
        self.bad_signatures = 0
        lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                want = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
                key = self.headers["idempotency-key"]
                with lock:
                    owner.bad_signatures += not hmac.compare_digest(want, self.headers["x-shardlb-signature"])
                    owner.posts[key] += 1
                    owner.in_flight[key] += 1
                    owner.most_at_once = max(owner.most_at_once, owner.in_flight[key])
                time.sleep(owner.delay_s)
                if key not in owner.quick:
                    owner.release.wait(60)
                with lock:
                    owner.in_flight[key] -= 1
                with contextlib.suppress(OSError):  # a sender that gave up has hung up
                    self.send_response(200 if owner.up else 503)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    with lock:
                        owner.answered[key] += 1

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/awards"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Hook:
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class Stop(Exception):
    """Raised by a step hook: a settlement that stopped before it stored anything."""


def stop_at(step: str) -> Callable[[str], None]:
    def hook(name: str) -> None:
        if name == step:
            raise Stop(name)

    return hook


@pytest.fixture
async def db(postgres_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    conn = await psycopg.AsyncConnection.connect(postgres_url, autocommit=True)
    yield conn
    await conn.close()


async def ready(store: BoardStore, raw: Any, postgres_url: str, name: str, *days: int) -> Board:
    """A board with results in the UTC days ``days`` ago, all archived into PostgreSQL."""
    board = await new_board(store, name)
    for days_ago in days:
        await written(board, day_ago(days_ago), f"{name}/{days_ago}")
    await drain(raw, store, postgres_url)
    return board


async def award_ids(db: psycopg.AsyncConnection[Any], settlement_id: str) -> set[str]:
    cur = await db.execute(
        "SELECT award_id FROM settlement_awards WHERE settlement_id = %s", (settlement_id,)
    )
    return {str(row[0]) for row in await cur.fetchall()}


async def attempts(db: psycopg.AsyncConnection[Any], settlement_id: str) -> Counter[int]:
    """How many of the settlement's deliveries have had each number of attempts."""
    cur = await db.execute(
        "SELECT attempts FROM settlement_deliveries JOIN settlement_awards USING (award_id) "
        "WHERE settlement_id = %s",
        (settlement_id,),
    )
    return Counter(row[0] for row in await cur.fetchall())


def test_the_retry_schedule_doubles_to_300_s_and_spans_twelve_hours() -> None:
    """router/README.md promises a wait doubling to 300 s: 8 tries waited 1 + 2 + ... + 64 = 127 s,
    so a receiver down for two minutes lost every award."""
    waits = [backoff(failures) for failures in range(1, MAX_ATTEMPTS)]
    assert waits[:10] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert set(waits[9:]) == {300}
    assert 12 * 3600 <= sum(waits) <= 13 * 3600
    assert backoff(3, base_s=0.5, cap_s=1.5) == 1.5


@pytest.mark.cluster
async def test_a_receiver_down_fails_each_delivery_after_every_attempt(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any], postgres_url: str
) -> None:
    board = await ready(store, raw, postgres_url, "hook-down", 2)
    try:
        with Hook(up=False) as hook:
            two = [{"ranks": [1, 2], "reward": "gold"}]  # two awards, each posted MAX_ATTEMPTS times
            body = {"settlement_id": "down-1", "rewards": two, "webhook_url": hook.url}
            result = await Settler(rebuilder).settle(board, day_ago(2), Request.of(body))
            counts = await deliver_until_done(db, SECRET, "down-1", deadline_s=60, **FAST)
        total = result["awards"]["total"]
        assert counts == {"delivered": 0, "pending": 0, "failed": total}
        assert set(hook.posts) == await award_ids(db, "down-1")
        assert set(hook.posts.values()) == {MAX_ATTEMPTS}
        assert await attempts(db, "down-1") == {MAX_ATTEMPTS: total}
    finally:
        await store.delete(board.config.id)


@pytest.mark.cluster
async def test_deliveries_failed_for_good_are_sent_again_when_the_settlement_runs_again(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any], postgres_url: str
) -> None:
    """The documented recovery: the same settlement requested again. It returned the stored result
    and sent nothing, since a delivery past its last attempt was never selected again."""
    board = await ready(store, raw, postgres_url, "hook-again", 2)
    try:
        with Hook() as hook:
            body = {"settlement_id": "again-1", "rewards": TABLE, "webhook_url": hook.url}
            first = await Settler(rebuilder).settle(board, day_ago(2), Request.of(body))
            total = first["awards"]["total"]
            await db.execute(  # every attempt used up while the receiver was down
                "UPDATE settlement_deliveries SET attempts = %s, last_error = 'HTTP 503' WHERE award_id IN "
                "(SELECT award_id FROM settlement_awards WHERE settlement_id = 'again-1')",
                (MAX_ATTEMPTS,),
            )
            assert await delivery_counts(db, "again-1") == {"delivered": 0, "pending": 0, "failed": total}
            assert await Settler(rebuilder).settle(board, day_ago(2), Request.of(body)) == first
            counts = await deliver_until_done(db, SECRET, "again-1", deadline_s=30, base_s=0.01)
        assert counts == {"delivered": total, "pending": 0, "failed": 0}
        assert set(hook.posts) == await award_ids(db, "again-1") and set(hook.posts.values()) == {1}
        assert hook.bad_signatures == 0
    finally:
        await store.delete(board.config.id)


@pytest.mark.cluster
async def test_two_deliverers_claim_each_delivery_once(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any], postgres_url: str
) -> None:
    """Two settle requests (or two routers) deliver one settlement at once: each row is claimed by one
    of them, so no delivery is posted twice at a time and no failure is counted twice. A deliverer
    whose claim ran out while it posted records nothing over the one that claimed the row since."""
    board = await ready(store, raw, postgres_url, "hook-two", 2)
    try:
        with Hook(up=False, delay_s=0.3) as hook:
            body = {"settlement_id": "two-1", "rewards": TABLE, "webhook_url": hook.url}
            result = await Settler(rebuilder).settle(board, day_ago(2), Request.of(body))
            total = result["awards"]["total"]
            async with (
                await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as other,
                httpx.AsyncClient() as http,
            ):
                await asyncio.gather(
                    deliver(db, http, SECRET, "two-1"), deliver(other, http, SECRET, "two-1")
                )
                assert hook.most_at_once == 1 and set(hook.posts.values()) == {1}
                assert await attempts(db, "two-1") == {1: total}

                # A claim of 0.05 s runs out while the receiver takes a second: a second deliverer
                # claims the rows meanwhile. Both post (at least once), one failure is counted.
                await db.execute(
                    "UPDATE settlement_deliveries SET next_at = now() WHERE award_id IN "
                    "(SELECT award_id FROM settlement_awards WHERE settlement_id = 'two-1')"
                )
                hook.delay_s = 1.0
                early = asyncio.create_task(deliver(db, http, SECRET, "two-1", lease_s=0.05))
                while hook.posts.total() < 2 * total:  # its posts are under way
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.1)  # and its claim has run out
                await deliver(other, http, SECRET, "two-1")
                await early
        assert set(hook.posts.values()) == {3}
        assert await attempts(db, "two-1") == {2: total}
    finally:
        await store.delete(board.config.id)


@pytest.mark.cluster
async def test_a_round_cancelled_mid_post_gives_its_claims_back(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any], postgres_url: str
) -> None:
    """A deliverer cancelled while its posts were out (its settlement requested again, the router
    stopping) kept its rows leased for LEASE_S: the next deliverer of the settlement found none due
    and waited 5 minutes. Now the cancelled round records the answers it has (a 2xx is delivered),
    and gives back, due at once and with no attempt counted, the rows whose posts it cut off and
    still holds; a row another deliverer has claimed since is left to that one."""
    board = await ready(store, raw, postgres_url, "hook-cancel", 2)
    try:
        with Hook(held=True) as hook:
            body = {"settlement_id": "cancel-1", "rewards": TABLE, "webhook_url": hook.url}
            result = await Settler(rebuilder).settle(board, day_ago(2), Request.of(body))
            total = result["awards"]["total"]
            first, taken, *_ = sorted(await award_ids(db, "cancel-1"), key=int)
            hook.quick = {first}
            async with httpx.AsyncClient() as http:
                round_ = asyncio.create_task(deliver(db, http, SECRET, "cancel-1"))
                while hook.posts.total() < total or not hook.answered[first]:  # all but one wait
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)  # and the sender has read its 200
                async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as other:
                    await other.execute(  # another deliverer's claim, taken once ours ran out
                        "UPDATE settlement_deliveries SET next_at = now() + interval '1 hour' "
                        "WHERE award_id = %s",
                        (int(taken),),
                    )
                round_.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await round_
                cur = await db.execute(
                    "SELECT award_id, attempts, delivered_at IS NOT NULL, next_at <= now() "
                    "FROM settlement_deliveries WHERE award_id = ANY(%s)",
                    ([int(i) for i in await award_ids(db, "cancel-1")],),
                )
                rows = {str(a): (n, done, due) for a, n, done, due in await cur.fetchall()}
                assert rows.pop(first)[:2] == (1, True)
                assert rows.pop(taken) == (0, False, False)
                assert set(rows.values()) == {(0, False, True)}
                hook.release.set()
                delivered, _ = await deliver(db, http, SECRET, "cancel-1")  # none waits out a lease
        assert delivered == total - 2
        assert await delivery_counts(db, "cancel-1") == {"delivered": total - 1, "pending": 1, "failed": 0}
        assert hook.posts[first] == 1 and hook.bad_signatures == 0
    finally:
        await store.delete(board.config.id)


def cancelling_in(
    db: psycopg.AsyncConnection[Any], nth: int, moment: str
) -> Callable[..., contextlib.AbstractAsyncContextManager[Any]]:
    """``db.transaction`` that cancels its caller's task in the round's ``nth`` transaction (1: the
    claim, 2: the record of the answers): ``body`` as its first statement goes out, ``commit`` as its
    COMMIT goes out (psycopg then asks the server to cancel, waits for the COMMIT's end and raises),
    ``after`` once its COMMIT is done, before the caller has its result (as psycopg raises when the
    server finished the COMMIT all the same)."""
    real = db.transaction
    count = iter(range(1, 1000))

    @contextlib.asynccontextmanager
    async def transaction(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        this = next(count) == nth
        task = asyncio.current_task()
        assert task is not None
        async with real(*args, **kwargs) as tx:
            if this and moment == "body":
                task.cancel()
            yield tx
            if this and moment == "commit":
                task.cancel()
        if this and moment == "after":
            task.cancel()
            await asyncio.sleep(0)

    return transaction


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("nth", "moment"),
    [(1, "commit"), (1, "after"), (2, "body")],
    ids=["as-the-claim-commits", "once-the-claim-has-committed", "as-the-answers-are-recorded"],
)
async def test_a_round_cancelled_in_its_own_transactions_leaves_nothing_on_the_lease(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    db: psycopg.AsyncConnection[Any],
    postgres_url: str,
    monkeypatch: pytest.MonkeyPatch,
    nth: int,
    moment: str,
) -> None:
    """A round cancelled while its claim committed (the rows leased in PostgreSQL, the list of them
    not yet returned to the round) gave back nothing: its give-back knew only the rows of a claim
    that had returned, and those rows waited out the 5-minute lease. So did the rows of a round
    cancelled as it recorded its answers (the record rolled back, every row still leased). Now the
    round knows its rows as the claim's query returns them, before the commit, and a cancelled
    record is made again by the give-back: the rows are due at once (the claim's rows, no attempt
    counted) or recorded (the answered ones)."""
    name = f"hook-window-{nth}-{moment}"
    sid = f"window-{nth}-{moment}"
    board = await ready(store, raw, postgres_url, name, 2)
    try:
        with Hook() as hook:
            body = {"settlement_id": sid, "rewards": TABLE, "webhook_url": hook.url}
            result = await Settler(rebuilder).settle(board, day_ago(2), Request.of(body))
            total = result["awards"]["total"]
            before = await (await db.execute("SELECT now()")).fetchone()
            async with httpx.AsyncClient() as http:
                asked: list[float] = []  # psycopg asked the server to cancel a statement
                cancel_safe = db.cancel_safe

                async def asking(*, timeout: float = 30.0) -> None:
                    asked.append(timeout)
                    await cancel_safe(timeout=timeout)

                with monkeypatch.context() as patched:
                    patched.setattr(db, "transaction", cancelling_in(db, nth, moment))
                    patched.setattr(db, "cancel_safe", asking)
                    round_ = asyncio.create_task(deliver(db, http, SECRET, sid))
                    with pytest.raises(asyncio.CancelledError):
                        await round_
                assert len(asked) == (moment != "after")  # it landed in psycopg's wait, as meant
                assert await leased(db, sid) == 0
                cur = await db.execute(
                    "SELECT attempts, delivered_at IS NOT NULL, next_at > %s, next_at <= now() "
                    "FROM settlement_deliveries JOIN settlement_awards USING (award_id) "
                    "WHERE settlement_id = %s",
                    ((before or (None,))[0], sid),
                )
                rows = Counter(tuple(row) for row in await cur.fetchall())
                if nth == 1:  # claimed (next_at moved), then given back: due now, no attempt counted
                    assert rows == {(0, False, True, True): total}
                    assert not hook.posts
                    assert await deliver(db, http, SECRET, sid) == (total, None)  # no lease to wait out
                else:  # posted, answered 2xx, and recorded so
                    assert {row[:2] for row in rows} == {(1, True)}
            assert await delivery_counts(db, sid) == {"delivered": total, "pending": 0, "failed": 0}
        assert set(hook.posts) == await award_ids(db, sid) and set(hook.posts.values()) == {1}
    finally:
        await store.delete(board.config.id)


@pytest.mark.cluster
async def test_the_first_webhook_url_is_part_of_the_settlement(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any], postgres_url: str
) -> None:
    """A first run with a webhook that stopped, retried without webhook_url, settled with no
    deliveries; sent again with the webhook it answered the stored result, no 409 and no delivery."""
    board = await ready(store, raw, postgres_url, "hook-keep", 2, 3, 4)
    try:
        with Hook() as hook:
            first = {"settlement_id": "keep-1", "rewards": TABLE, "webhook_url": hook.url}
            bare = {"settlement_id": "keep-1", "rewards": TABLE}
            moved = {**first, "webhook_url": hook.url + "/moved"}
            with pytest.raises(Stop):
                await Settler(rebuilder, stop_at("check")).settle(board, day_ago(2), Request.of(first))
            with pytest.raises(SettlementConflict) as e:
                await Settler(rebuilder).settle(board, day_ago(2), Request.of(moved))
            assert e.value.code == "settlement_conflict"
            done = await Settler(rebuilder).settle(board, day_ago(2), Request.of(bare))
            total = done["awards"]["total"]
            assert done["webhook_url"] == hook.url
            assert await delivery_counts(db, "keep-1") == {"delivered": 0, "pending": total, "failed": 0}
            assert await Settler(rebuilder).settle(board, day_ago(2), Request.of(first)) == done
            with pytest.raises(SettlementConflict) as e:
                await Settler(rebuilder).settle(board, day_ago(2), Request.of(moved))
            assert e.value.code == "settlement_conflict"

            # Settled without a webhook: one named later is refused; none named returns the result.
            plain = {"settlement_id": "keep-2", "rewards": TABLE}
            settled = await Settler(rebuilder).settle(board, day_ago(3), Request.of(plain))
            assert settled["webhook_url"] is None
            with pytest.raises(SettlementConflict) as e:
                await Settler(rebuilder).settle(
                    board, day_ago(3), Request.of({**plain, "webhook_url": hook.url})
                )
            assert e.value.code == "settlement_conflict"
            assert await delivery_counts(db, "keep-2") == {"delivered": 0, "pending": 0, "failed": 0}

            # Stopped without one (nothing paid yet): a run naming one is the first to store one.
            late = {"settlement_id": "keep-3", "rewards": TABLE}
            with pytest.raises(Stop):
                await Settler(rebuilder, stop_at("check")).settle(board, day_ago(4), Request.of(late))
            named = await Settler(rebuilder).settle(
                board, day_ago(4), Request.of({**late, "webhook_url": hook.url})
            )
            assert named["webhook_url"] == hook.url
            assert (await delivery_counts(db, "keep-3"))["pending"] == named["awards"]["total"]
    finally:
        await store.delete(board.config.id)


@pytest.mark.cluster
async def test_over_http_a_stored_webhook_needs_the_secret_and_a_rerun_delivers_to_it(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    db: psycopg.AsyncConnection[Any],
    cluster_url: str,
    postgres_url: str,
) -> None:
    """The router checked the secret only when the request named a URL, then delivered to the
    stored one signing with "" (SHARDLB_WEBHOOK_SECRET's default)."""
    name = board_name("hook-http")
    board = await ready(store, raw, postgres_url, name, 2)
    sid = f"http-{name}"
    try:
        with Hook() as hook:
            body = {"settlement_id": sid, "rewards": TABLE, "webhook_url": hook.url}
            with pytest.raises(Stop):
                await Settler(rebuilder, stop_at("check")).settle(board, day_ago(2), Request.of(body))
            url = f"/v1/boards/{name}/periods/{day_ago(2)}:settle"
            async with running(cluster_url, postgres_url=postgres_url) as (_, client):  # no secret
                refused = await client.post(
                    url, json={"settlement_id": sid, "rewards": TABLE}, headers=AS_ADMIN
                )
                assert (refused.status_code, refused.json()["error"]["code"]) == (
                    409,
                    "webhook_not_configured",
                )
                state = (await client.get(f"/v1/settlements/{sid}", headers=AS_WRITER)).json()["state"]
                assert state == "started"
            signed = running(
                cluster_url,
                postgres_url=postgres_url,
                webhook_secret=SECRET,
                settlement_webhook_url="http://127.0.0.1:9/default",  # for new settlements only
            )
            async with signed as (_, client):
                bad = await client.post(url, json={**body, "webhook_url": "http://[::1"}, headers=AS_ADMIN)
                assert (bad.status_code, bad.json()["error"]["code"]) == (422, "invalid_input")
                assert bad.json()["error"]["field"] == "webhook_url"
                ok = await client.post(url, json={"settlement_id": sid, "rewards": TABLE}, headers=AS_ADMIN)
                assert ok.status_code == 200, ok.text
                assert ok.json()["webhook_url"] == hook.url  # the stored one, not the router's default
                moved = await client.post(url, json={**body, "webhook_url": hook.url + "x"}, headers=AS_ADMIN)
                assert (moved.status_code, moved.json()["error"]["code"]) == (409, "settlement_conflict")
                total = ok.json()["awards"]["total"]
                for _ in range(200):  # the router's task delivers after the answer
                    if (await delivery_counts(db, sid))["delivered"] == total:
                        break
                    await asyncio.sleep(0.05)
            assert await delivery_counts(db, sid) == {"delivered": total, "pending": 0, "failed": 0}
            assert set(hook.posts) == await award_ids(db, sid) and hook.bad_signatures == 0
    finally:
        await store.delete(name)


@pytest.mark.cluster
async def test_an_archive_run_again_once_its_board_is_gone_needs_the_secret_for_its_webhook(
    store: BoardStore, raw: Any, db: psycopg.AsyncConnection[Any], cluster_url: str, postgres_url: str
) -> None:
    """The deleted board's path compared only id, board and period: without the secret it answered
    200 and left the deliveries pending; with another URL it answered 200 for the first one."""
    name = board_name("hook-season")
    board = await new_board(store, name)
    sid = f"season-{name}"
    try:
        now = time.time_ns() // 1_000_000
        await board.submit([Score(f"p{i}", 10 * i, f"{name}-m{i}", now - 1000) for i in range(1, 4)])
        await drain(raw, store, postgres_url)
        url = f"/v1/boards/{name}:archive"
        with Hook() as hook:
            body = {"settlement_id": sid, "rewards": TABLE, "webhook_url": hook.url}
            async with running(cluster_url, postgres_url=postgres_url, webhook_secret=SECRET) as (_, client):
                done = await client.post(url, json=body, headers=AS_ADMIN)
                assert done.status_code == 200, done.text
                moved = await client.post(url, json={**body, "webhook_url": hook.url + "x"}, headers=AS_ADMIN)
                error = moved.json()["error"]
                assert (moved.status_code, error["code"], error["field"]) == (
                    409,
                    "settlement_conflict",
                    "webhook_url",
                )
            async with running(cluster_url, postgres_url=postgres_url) as (_, client):  # no secret
                refused = await client.post(
                    url, json={"settlement_id": sid, "rewards": TABLE}, headers=AS_ADMIN
                )
                assert (refused.status_code, refused.json()["error"]["code"]) == (
                    409,
                    "webhook_not_configured",
                )
    finally:
        if name in {c.id for c in await store.list()}:
            await store.delete(name)


@pytest.mark.cluster
async def test_the_command_delivers_to_the_stored_webhook_and_needs_the_secret(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    db: psycopg.AsyncConnection[Any],
    cluster_url: str,
    postgres_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = board_name("hook-cli")
    board = await ready(store, raw, postgres_url, name, 2)
    sid = f"cli-{name}"
    try:
        with Hook() as hook:
            body = {"settlement_id": sid, "rewards": TABLE, "webhook_url": hook.url}
            with pytest.raises(Stop):
                await Settler(rebuilder, stop_at("check")).settle(board, day_ago(2), Request.of(body))
            argv = ["settle", name, day_ago(2), "--id", sid, "--rewards", json.dumps(TABLE)]
            argv += ["--redis", cluster_url, "--postgres", postgres_url]
            monkeypatch.delenv("SHARDLB_WEBHOOK_SECRET", raising=False)
            assert await asyncio.to_thread(main, argv) == 1
            assert "SHARDLB_WEBHOOK_SECRET" in capsys.readouterr().err
            assert (await settlement_delivery.get(db, sid))["state"] == "started"
            monkeypatch.setenv("SHARDLB_WEBHOOK_SECRET", SECRET)
            assert await asyncio.to_thread(main, argv) == 0
            out = json.loads(capsys.readouterr().out)
        assert out["webhook_url"] == hook.url
        assert out["delivery"] == {"delivered": out["awards"]["total"], "pending": 0, "failed": 0}
        assert set(hook.posts) == await award_ids(db, sid) and hook.bad_signatures == 0
    finally:
        await store.delete(name)


@pytest.mark.parametrize(
    "url",
    [
        "http://[::1",
        "http://",
        "https:///awards",
        "ftp://x.test/h",
        "http://x.test:99999/h",
        7,
        "http://xn--/",
        "http://xn--a/",
        "https://xn--zz-ab.test/h",
        "http://\u2100.com/",
        "http://\udcff/",
        "http://\x00/",
        "http://a.test:0/",
    ],
)
def test_a_malformed_webhook_url_is_invalid_input(url: object) -> None:
    """``http://[::1`` passed the prefix check, then httpx.InvalidURL escaped every delivery; a host
    that is not valid IDNA (``xn--``) raised idna.IDNAError from ``url.host``, a 500."""
    with pytest.raises(InvalidInput) as e:
        Request.of({"settlement_id": "x", "rewards": TABLE, "webhook_url": url})
    assert (e.value.code, e.value.field) == ("invalid_input", "webhook_url")


@settings(max_examples=300, deadline=None)
@given(
    st.from_regex(str(openapi._WEBHOOK_URL["pattern"]), fullmatch=True).filter(lambda url: len(url) <= 2048)
)
def test_every_url_the_openapi_pattern_allows_is_accepted(url: str) -> None:
    """The spec's pattern is the usual form (schemathesis sends what it allows and expects no 422);
    Request.of takes more (IPv6 literals, any host httpx can send to), never less."""
    assert Request.of({"settlement_id": "x", "rewards": TABLE, "webhook_url": url}).webhook_url == url


@pytest.mark.cluster
async def test_a_send_that_raises_is_a_failed_attempt(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    db: psycopg.AsyncConnection[Any],
    postgres_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A URL stored before Request.of checked it (or any error of a send) is one failed attempt of
    that delivery, logged; the others are delivered. Nothing is ever signed with an empty secret."""
    board = await ready(store, raw, postgres_url, "hook-raise", 2)
    try:
        with Hook() as hook:
            body = {"settlement_id": "raise-1", "rewards": TABLE, "webhook_url": hook.url}
            result = await Settler(rebuilder).settle(board, day_ago(2), Request.of(body))
            cur = await db.execute(
                "UPDATE settlement_deliveries SET url = 'http://[::1' WHERE award_id = (SELECT min(award_id) "
                "FROM settlement_awards WHERE settlement_id = 'raise-1') RETURNING award_id"
            )
            broken = (await cur.fetchone() or (None,))[0]
            async with httpx.AsyncClient() as http:
                with pytest.raises(SettlementConflict) as e:
                    await deliver(db, http, "", "raise-1")
                assert e.value.code == "webhook_not_configured"
                with caplog.at_level(logging.WARNING, logger="shardlb.settlement"):
                    delivered, wait = await deliver(db, http, SECRET, "raise-1")
        assert delivered == result["awards"]["total"] - 1 and wait is not None
        cur = await db.execute(
            "SELECT attempts, last_error FROM settlement_deliveries WHERE award_id = %s", (broken,)
        )
        tried, error = await cur.fetchone() or (0, "")
        assert tried == 1 and "InvalidURL" in error
        assert any("InvalidURL" in getattr(r, "fields", {}).get("error", "") for r in caplog.records)
        assert str(broken) not in hook.posts
    finally:
        await store.delete(board.config.id)


def delivering() -> list[asyncio.Task[Any]]:
    """The router's webhook delivery tasks still running in this loop (router/settlements.py)."""
    return [t for t in asyncio.all_tasks() if "_deliver_later" in getattr(t.get_coro(), "__qualname__", "")]


@pytest.mark.cluster
async def test_a_router_stopping_stops_its_deliveries(
    store: BoardStore, raw: Any, db: psycopg.AsyncConnection[Any], cluster_url: str, postgres_url: str
) -> None:
    """A router's delivery task outlived the router's stop: it kept posting, and kept its PostgreSQL
    connection, for as long as the 12-hour schedule lasted. Now stopping the router cancels it; its
    claimed rows go back to the schedule when their lease ends, for the archivers' sweep."""
    name = board_name("hook-stop")
    await ready(store, raw, postgres_url, name, 2)
    sid = f"stop-{name}"
    try:
        with Hook(up=False) as hook:
            url = f"/v1/boards/{name}/periods/{day_ago(2)}:settle"
            body = {"settlement_id": sid, "rewards": TABLE, "webhook_url": hook.url}
            async with running(cluster_url, postgres_url=postgres_url, webhook_secret=SECRET) as (_, client):
                ok = await client.post(url, json=body, headers=AS_ADMIN)
                assert ok.status_code == 200, ok.text
                for _ in range(200):
                    if hook.posts:
                        break
                    await asyncio.sleep(0.05)
                assert hook.posts and delivering()
            assert delivering() == []
            # A post already on the wire when the stop cancelled its task still lands (a CI run of
            # 2026-12-05 counted one after the stop): counted from half a second on, before the
            # schedule's next attempts, due 1 s and 2 s after.
            await asyncio.sleep(0.5)
            posted = sum(hook.posts.values())
            await asyncio.sleep(2.0)
            assert sum(hook.posts.values()) == posted
    finally:
        await store.delete(name)


@pytest.mark.cluster
@pytest.mark.parametrize("again", [1, 2], ids=["again", "twice-more"])
async def test_a_settlement_requested_again_while_delivering_sends_at_once(
    store: BoardStore,
    raw: Any,
    db: psycopg.AsyncConnection[Any],
    cluster_url: str,
    postgres_url: str,
    again: int,
) -> None:
    """A request for a settlement whose deliveries this router is sending replaces its task. The
    cancelled task's rows kept their 5-minute lease, so the new task found nothing due and slept
    until the lease ran out: a receiver that was slow once got its awards 5 minutes late. Now the
    cancelled task gives its claims back and the new one starts once it has (here the give-back
    waits on row locks a while, as on a busy PostgreSQL: a new task that did not wait for it found
    the rows still leased).

    Requested twice more: each request replaces the task before it, which waited for the one it had
    replaced to give its claims back. Replaced in turn while it waited, it ended at once, and the
    third task, waiting for it alone, started while the first still held its rows: its first round
    found them leased, and it slept until the lease ran out (until 2026-12-05). The replaced tasks'
    give-backs are waited for whatever the number of requests again."""
    name = board_name(f"hook-again{again}-http")
    await ready(store, raw, postgres_url, name, 2)
    sid = f"again{again}-{name}"
    try:
        with Hook(held=True) as hook:
            url = f"/v1/boards/{name}/periods/{day_ago(2)}:settle"
            body = {"settlement_id": sid, "rewards": TABLE, "webhook_url": hook.url}
            async with running(cluster_url, postgres_url=postgres_url, webhook_secret=SECRET) as (_, client):
                ok = await client.post(url, json=body, headers=AS_ADMIN)
                assert ok.status_code == 200, ok.text
                total = ok.json()["awards"]["total"]
                for _ in range(200):  # the first task's posts are out, and held
                    if hook.posts.total() == total:
                        break
                    await asyncio.sleep(0.05)
                async with await psycopg.AsyncConnection.connect(postgres_url) as locker:
                    await locker.execute(
                        "SELECT 1 FROM settlement_deliveries WHERE award_id IN (SELECT award_id FROM "
                        "settlement_awards WHERE settlement_id = %s) FOR UPDATE",
                        (sid,),
                    )
                    for _ in range(again):
                        answer = await client.post(url, json=body, headers=AS_ADMIN)
                        assert answer.status_code == 200 and answer.json() == ok.json()
                    await asyncio.sleep(2)
                    await locker.commit()
                hook.release.set()
                for _ in range(600):  # 30 s, far inside the 300 s lease
                    if (await delivery_counts(db, sid))["delivered"] == total:
                        break
                    await asyncio.sleep(0.05)
                assert await delivery_counts(db, sid) == {"delivered": total, "pending": 0, "failed": 0}
        assert set(hook.posts) == await award_ids(db, sid) and hook.bad_signatures == 0
        assert set(hook.posts.values()) <= {1, 2}  # the cut-off post, and the one delivered
    finally:
        await store.delete(name)


async def leased(db: psycopg.AsyncConnection[Any], settlement_id: str) -> int:
    """The settlement's deliveries still held under a claim's lease (not due within a minute)."""
    cur = await db.execute(
        "SELECT count(*) FROM settlement_deliveries JOIN settlement_awards USING (award_id) "
        "WHERE settlement_id = %s AND delivered_at IS NULL AND next_at > now() + interval '1 minute'",
        (settlement_id,),
    )
    return int((await cur.fetchone() or (0,))[0])


async def replaced_then_stopped(
    cluster_url: str,
    postgres_url: str,
    locker: psycopg.AsyncConnection[Any],
    name: str,
    drain_seconds: float,
    hold_s: float | None,
) -> tuple[str, list[asyncio.Task[Any]]]:
    """Settle with a held receiver, request the settlement again while ``locker`` holds its rows (so
    the replaced task's give-back waits on the locks), then stop the router; ``locker`` lets go
    ``hold_s`` after the stop begins (None: the caller does, later). Returns the settlement id and
    the router's delivery tasks still running once the stop is over."""
    sid = f"replaced-{name}"
    with Hook(held=True) as hook:
        url = f"/v1/boards/{name}/periods/{day_ago(2)}:settle"
        body = {"settlement_id": sid, "rewards": TABLE, "webhook_url": hook.url}
        async with running(
            cluster_url, postgres_url=postgres_url, webhook_secret=SECRET, drain_seconds=drain_seconds
        ) as (_, client):
            ok = await client.post(url, json=body, headers=AS_ADMIN)
            assert ok.status_code == 200, ok.text
            for _ in range(200):  # the first task's posts are out, and held
                if hook.posts.total() == ok.json()["awards"]["total"]:
                    break
                await asyncio.sleep(0.05)
            await locker.execute(
                "SELECT 1 FROM settlement_deliveries WHERE award_id IN (SELECT award_id FROM "
                "settlement_awards WHERE settlement_id = %s) FOR UPDATE",
                (sid,),
            )
            assert (await client.post(url, json=body, headers=AS_ADMIN)).status_code == 200
            await asyncio.sleep(0.5)  # the replaced task's posts are cut off; its give-back waits
            assert len(delivering()) == 2  # it, and the new task waiting for it
            if hold_s is not None:

                async def let_go(hold_s: float) -> None:
                    await asyncio.sleep(hold_s)
                    await locker.commit()

                releasing = asyncio.create_task(let_go(hold_s))
        left = delivering()
    if hold_s is not None:
        await releasing
    return sid, left


@pytest.mark.cluster
async def test_a_router_stopping_waits_for_a_replaced_delivery_to_give_its_claims_back(
    store: BoardStore, raw: Any, db: psycopg.AsyncConnection[Any], cluster_url: str, postgres_url: str
) -> None:
    """A request for a settlement this router delivers replaces its task; the replaced one, cancelled,
    gives back the rows it claimed. Stopping the router cancelled the new task (waiting for the old
    one) and did not wait for the old one, gone from ``Service.deliveries``: a worker exiting then
    cut the give-back off, and the rows waited out their 5-minute lease. Now the stop waits for
    every delivery task, within SHARDLB_DRAIN_SECONDS (here the give-back waits on row locks for 1 s,
    as on a busy PostgreSQL)."""
    name = board_name("hook-stop-replaced")
    await ready(store, raw, postgres_url, name, 2)
    try:
        async with await psycopg.AsyncConnection.connect(postgres_url) as locker:
            sid, left = await replaced_then_stopped(cluster_url, postgres_url, locker, name, 30, 1.0)
        assert left == []
        assert await leased(db, sid) == 0  # given back: due at once, for a sweep
    finally:
        await store.delete(name)


@pytest.mark.cluster
async def test_a_give_back_that_outlasts_the_drain_is_cut_off_at_its_end(
    store: BoardStore, raw: Any, db: psycopg.AsyncConnection[Any], cluster_url: str, postgres_url: str
) -> None:
    """The wait is bounded by SHARDLB_DRAIN_SECONDS: a give-back still waiting on its locks then is
    cut off (its rows wait out their lease, as a killed worker's) and the stop ends with no task left."""
    name = board_name("hook-stop-late")
    await ready(store, raw, postgres_url, name, 2)
    try:
        async with await psycopg.AsyncConnection.connect(postgres_url) as locker:
            sid, left = await replaced_then_stopped(cluster_url, postgres_url, locker, name, 1, None)
            assert left == []
            await locker.commit()
        assert await leased(db, sid) > 0
    finally:
        await store.delete(name)


@pytest.mark.cluster
async def test_a_delivery_due_never_with_attempts_left(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any], postgres_url: str
) -> None:
    """``next_at = 'infinity'`` marks a delivery past its last attempt. A row so marked with attempts
    left (an operator pausing one, or resetting ``attempts`` by hand to retry those that failed for
    good; a release with more attempts than the one that gave up) broke every round of its
    settlement once it was the earliest left: ``min(next_at) - now()`` is out of an interval's range,
    so the round raised after posting, the router's task stopped, and a run of the settlement again
    stopped the same way; the row counted as pending for ever and ``retry_failed`` never took it.
    Now such a row is due never, counts as failed for good, and a run again gives it a schedule."""
    board = await ready(store, raw, postgres_url, "hook-infinity", 2)
    try:
        with Hook() as hook:
            body = {"settlement_id": "infinity-1", "rewards": TABLE, "webhook_url": hook.url}
            result = await Settler(rebuilder).settle(board, day_ago(2), Request.of(body))
            total = result["awards"]["total"]
            cur = await db.execute(
                "UPDATE settlement_deliveries SET next_at = 'infinity' WHERE award_id = "
                "(SELECT min(award_id) FROM settlement_awards WHERE settlement_id = 'infinity-1') "
                "RETURNING award_id"
            )
            paused = str((await cur.fetchone() or (None,))[0])
            async with httpx.AsyncClient() as http:
                assert await deliver(db, http, SECRET, "infinity-1") == (total - 1, None)
            assert paused not in hook.posts
            assert await delivery_counts(db, "infinity-1") == {
                "delivered": total - 1,
                "pending": 0,
                "failed": 1,
            }
            counts = await deliver_until_done(db, SECRET, "infinity-1", deadline_s=30, **FAST)
        assert counts == {"delivered": total, "pending": 0, "failed": 0}
        assert set(hook.posts) == await award_ids(db, "infinity-1") and set(hook.posts.values()) == {1}
    finally:
        await store.delete(board.config.id)


@pytest.mark.cluster
async def test_the_sweep_sends_what_no_process_is_delivering(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any], postgres_url: str
) -> None:
    """Deliveries left by a stopped router or command were sent only when someone requested that
    settlement again. An archiver with SHARDLB_WEBHOOK_SECRET now sweeps every settlement's due
    deliveries (settlement_delivery.sweep_forever), on the same claims, so it never posts one a
    router is posting; one past its last attempt waits for the settlement to be run again."""
    board = await ready(store, raw, postgres_url, "hook-sweep", 2)
    try:
        with Hook() as hook:
            body = {"settlement_id": "sweep-1", "rewards": TABLE, "webhook_url": hook.url}
            result = await Settler(rebuilder).settle(board, day_ago(2), Request.of(body))
            total = result["awards"]["total"]
            cur = await db.execute(
                "UPDATE settlement_deliveries SET attempts = %s WHERE award_id = (SELECT min(award_id) "
                "FROM settlement_awards WHERE settlement_id = 'sweep-1') RETURNING award_id",
                (MAX_ATTEMPTS,),
            )
            failed = str((await cur.fetchone() or (None,))[0])
            stop = asyncio.Event()
            sweeper = asyncio.create_task(
                settlement_delivery.sweep_forever(postgres_url, SECRET, stop, every_s=0.05, **FAST)
            )
            try:
                for _ in range(200):
                    if (await delivery_counts(db, "sweep-1"))["delivered"] == total - 1:
                        break
                    await asyncio.sleep(0.05)
            finally:
                stop.set()
                await sweeper
        assert await delivery_counts(db, "sweep-1") == {"delivered": total - 1, "pending": 0, "failed": 1}
        shown = await settlement_delivery.get(db, "sweep-1")  # GET /v1/settlements/{id}
        assert shown["delivery"] == {"delivered": total - 1, "pending": 0, "failed": 1}
        assert set(hook.posts) == await award_ids(db, "sweep-1") - {failed}
        assert set(hook.posts.values()) == {1} and hook.bad_signatures == 0
    finally:
        await store.delete(board.config.id)


@pytest.mark.cluster
async def test_one_settlement_whose_receiver_is_down_does_not_starve_the_sweep_of_others(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, db: psycopg.AsyncConnection[Any], postgres_url: str
) -> None:
    """The sweep looked only at the 1000 oldest due rows: a big settlement made first, its receiver
    down, filled them, and a settlement made after it waited hours. And its claims went by rank, so
    the first ranks, due again after each failure, were retried while later ranks were never tried.
    Now every settlement with a due row gets its rounds, and rows are claimed oldest due first."""
    board = await ready(store, raw, postgres_url, "hook-starve", 2)
    try:
        with Hook(up=False) as down, Hook() as up:
            big = {"settlement_id": "starve-big", "rewards": TABLE, "webhook_url": down.url}
            await Settler(rebuilder).settle(board, day_ago(2), Request.of(big))
            await db.execute(  # its rows due for an hour: older than any other settlement's
                "UPDATE settlement_deliveries SET next_at = now() - interval '1 hour' WHERE award_id IN "
                "(SELECT award_id FROM settlement_awards WHERE settlement_id = 'starve-big')"
            )
            # The old sweep's window of the 1000 oldest due rows, scaled down to this test's size.
            monkey = getattr(settlement_delivery, "SWEEP_ROWS", None)
            settlement_delivery.SWEEP_ROWS = 1  # type: ignore[attr-defined]
            try:
                small = await ready(store, raw, postgres_url, "hook-starve-small", 2)
                body = {"settlement_id": "starve-small", "rewards": TABLE, "webhook_url": up.url}
                result = await Settler(rebuilder).settle(small, day_ago(2), Request.of(body))
                async with httpx.AsyncClient() as http:
                    await settlement_delivery.sweep(db, http, SECRET, **FAST)
                counts = await delivery_counts(db, "starve-small")
                assert counts["delivered"] == result["awards"]["total"], counts
                await store.delete(small.config.id)
            finally:
                settlement_delivery.SWEEP_ROWS = monkey  # type: ignore[attr-defined]
            # claims by due time: after the first ranks failed, the never tried ranks go first
            tried = await db.execute(
                "SELECT count(*) FILTER (WHERE d.attempts = 0) FROM settlement_deliveries d "
                "JOIN settlement_awards a USING (award_id) WHERE a.settlement_id = 'starve-big'"
            )
            assert (await tried.fetchone() or (1,))[0] == 0
    finally:
        await store.delete(board.config.id)


class Answering:
    """A receiver on 127.0.0.1 whose answer is ``answer(handler)``'s to write, on a raw socket
    stream (a huge body, headers a byte at a time, a redirect); counts the bytes it got out and the
    POSTs each path was sent."""

    def __init__(self, answer: Callable[[BaseHTTPRequestHandler], Iterator[int]]) -> None:
        self.written = 0
        self.paths: Counter[str] = Counter()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                owner.paths[self.path] += 1
                with contextlib.suppress(OSError):  # the client hung up: what it would not read
                    for written in answer(self):
                        owner.written += written

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Answering:
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


HUGE = 256 * 2**20


def huge_body(handler: BaseHTTPRequestHandler) -> Iterator[int]:
    """200 with a body of HUGE bytes, sent 1 MiB at a time for as long as the client reads."""
    handler.send_response(200)
    handler.send_header("content-length", str(HUGE))
    handler.end_headers()
    chunk = b"x" * 2**20
    for _ in range(HUGE // len(chunk)):
        handler.wfile.write(chunk)
        yield len(chunk)


def trickled_headers(handler: BaseHTTPRequestHandler) -> Iterator[int]:
    """A status line and then one header byte every 50 ms, for ever (until the client hangs up)."""
    handler.wfile.write(b"HTTP/1.1 200 OK\r\nx-slow: ")
    for _ in range(10_000):
        handler.wfile.write(b"a")
        handler.wfile.flush()
        yield 1
        time.sleep(0.05)


def redirect(handler: BaseHTTPRequestHandler) -> Iterator[int]:
    handler.send_response(307)
    handler.send_header("location", "/elsewhere")
    handler.send_header("content-length", "0")
    handler.end_headers()
    yield 0


async def one_delivery(
    db: psycopg.AsyncConnection[Any], settlement_id: str, url: str
) -> tuple[int, str | None]:
    """(attempts, last_error or None once delivered) of the settlement's first delivery not
    delivered yet, its URL set to ``url`` and due now, after one ``deliver`` round."""
    cur = await db.execute(
        "UPDATE settlement_deliveries SET url = %s, next_at = now() WHERE award_id = (SELECT "
        "min(award_id) FROM settlement_deliveries JOIN settlement_awards USING (award_id) "
        "WHERE settlement_id = %s AND delivered_at IS NULL) RETURNING award_id",
        (url, settlement_id),
    )
    award = (await cur.fetchone() or (None,))[0]
    await db.execute(
        "UPDATE settlement_deliveries SET next_at = now() + interval '1 day' WHERE award_id IN (SELECT "
        "award_id FROM settlement_awards WHERE settlement_id = %s) AND award_id <> %s",
        (settlement_id, award),
    )
    async with httpx.AsyncClient() as http:
        await deliver(db, http, SECRET, settlement_id)
    cur = await db.execute(
        "SELECT attempts, last_error, delivered_at IS NOT NULL FROM settlement_deliveries "
        "WHERE award_id = %s",
        (award,),
    )
    tried, error, delivered = await cur.fetchone() or (0, None, False)
    return tried, None if delivered else (error or "")


@pytest.mark.cluster
async def test_receivers_that_answer_huge_slowly_or_with_a_redirect(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    db: psycopg.AsyncConnection[Any],
    postgres_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 2xx is known from the status line: the body of the answer is not read, so a receiver that
    answers with a huge body costs no memory (the whole body was read into RAM, for up to the 10 s
    of the timeout, and a body too big to come in 10 s made a 2xx a failed attempt). A receiver that
    trickles its headers is cut at the timeout; a redirect is not followed: a failed attempt."""
    board = await ready(store, raw, postgres_url, "hook-answers", 2)
    monkeypatch.setattr(settlement_delivery, "TIMEOUT_S", 1.0)
    try:
        body = {"settlement_id": "answers-1", "rewards": TABLE, "webhook_url": "http://127.0.0.1:9/x"}
        await Settler(rebuilder).settle(board, day_ago(2), Request.of(body))
        with Answering(huge_body) as huge:
            assert await one_delivery(db, "answers-1", huge.base + "/awards") == (1, None)
        assert huge.written < 32 * 2**20  # what the sockets' buffers took: the client read no more
        with Answering(trickled_headers) as slow:
            started = time.monotonic()
            tried, error = await one_delivery(db, "answers-1", slow.base + "/awards")
            assert time.monotonic() - started < 5
        assert tried == 1 and error is not None and "Timeout" in error, error
        with Answering(redirect) as moved:
            assert await one_delivery(db, "answers-1", moved.base + "/awards") == (2, "HTTP 307")
        assert moved.paths == {"/awards": 1}
    finally:
        await store.delete(board.config.id)
