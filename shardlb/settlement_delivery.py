"""Awards delivery: a settlement read back, its awards paged and acknowledged, and the webhook.

A game server pays awards by paging ``awards`` (a cursor on the rank; acknowledged awards are left
out, so a page read again after an ack offers only what is still unpaid) and acknowledging the
award ids it paid; an ack is idempotent and all or nothing.

The webhook is at-least-once: the settlement's transaction writes one ``settlement_deliveries`` row
per award; ``deliver`` claims due rows, POSTs each, marks it delivered on a 2xx, and otherwise (any
other answer, or any error of the send) sets its next attempt after ``backoff``: 1, 2, 4 ... 256 s,
then every 300 s, ``MAX_ATTEMPTS`` (154) in all, about 12 hours; a row past its last attempt has
failed for good. A delivery answered 2xx whose mark is lost (a crash right then) is sent again:
receivers deduplicate on the ``Idempotency-Key`` header, the award id. The body is signed with
HMAC-SHA256 over its exact bytes under SHARDLB_WEBHOOK_SECRET (header ``X-Shardlb-Signature:
sha256=<hex>``); nothing is sent without a secret. Only the status line of an answer counts: its
body is never read (the connection is closed instead), so a receiver answering with a huge body
costs no memory, and a redirect is not followed (a failed attempt, as any status but 2xx). One POST
has TIMEOUT_S in all, connect to status line.

Claims: a round claims its rows in one short transaction (``FOR UPDATE SKIP LOCKED``) that pushes
their ``next_at`` ``LEASE_S`` ahead, so another deliverer of the same settlement (a second settle
request, another router) passes them by; the round's outcome is recorded only while ``next_at`` is
still its lease, so a deliverer whose lease ran out never counts a failure twice. A deliverer killed
mid-round leaves its rows to the next one once the lease ends; one cancelled mid-round (its
settlement requested again, its router stopping) records the answers it has and gives back, due at
once, the rows it still holds, since by then none of its posts is in flight. That holds wherever
the cancellation lands: as its claim commits (the round has the rows from the claim's query, before
the commit) or as it records (the record is made again, a no-op where the first one went through).
A receiver may still be working on a post cut off so: its ``Idempotency-Key`` makes the next one
harmless.

A delivery past its last attempt is due never (``next_at`` 'infinity'); a row with that mark counts
as failed for good whatever its ``attempts`` say (``PENDING``), so one marked by hand is neither sent
nor a due time to wait for until ``retry_failed``.

``deliver_until_done`` (each settle request or `shardlb settle` run, first or again) starts by
giving the deliveries that failed for good a new schedule, then delivers until none is left to try.
``sweep_forever`` (every `shardlb archive` given SHARDLB_WEBHOOK_SECRET) sends whatever is due that
no such process is sending: what a stopped router or command left, on the same claims.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
from typing import Any

import httpx
import orjson
import psycopg

from shardlb import periods, pgconn
from shardlb.config import check_id
from shardlb.errors import InvalidInput, SettlementConflict, SettlementNotFound
from shardlb.outage import Outage

log = logging.getLogger("shardlb.settlement")

BASE_S = 1.0
MAX_BACKOFF_S = 300.0
# Waits of 1, 2, 4 ... 256 s between the first 10 attempts (511 s), then 144 waits of 300 s: the
# last attempt comes 43,711 s (12 h 8 min) after the first, so a receiver down for hours loses nothing.
MAX_ATTEMPTS = 154
TIMEOUT_S = 10.0  # one POST in all (connect, send, answer)
IN_FLIGHT = 8  # webhook POSTs at once
CLAIM = 64  # rows a round claims: at most CLAIM / IN_FLIGHT * TIMEOUT_S = 80 s of posting
LEASE_S = 300.0  # how long a claim keeps other deliverers off its rows (longer than a round)
SWEEP_EVERY_S = 5.0  # between an archiver's sweeps of due deliveries (`shardlb archive --deliver-every`)
SWEEP_BUDGET_S = 30.0  # a sweep's rounds for one settlement, at most, before the next one's
SIGNATURE = "X-Shardlb-Signature"
CURSOR_DIGITS = 12  # an awards page's cursor (`after`): the rank it ends at, at most this many digits
# A delivery with an attempt to come (the placeholder: MAX_ATTEMPTS). Not one due 'infinity' with
# attempts left (set by hand, to hold a delivery back or on attempts reset without next_at): a due
# time computed from it raised (an interval cannot hold it) and stopped every round of its
# settlement, and retry_failed, which took only attempts >= MAX_ATTEMPTS, never gave it a schedule.
PENDING = "d.delivered_at IS NULL AND d.attempts < %s AND d.next_at < 'infinity'"
MAX_ACK = 1000


def signature(secret: str, body: bytes) -> str:
    """The signature header's value for ``body`` (what a receiver recomputes and compares)."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


async def get(db: psycopg.AsyncConnection[Any], settlement_id: str, counts: bool = True) -> dict[str, Any]:
    """The settlement as stored: its result once settled (with the count acknowledged so far and,
    with a webhook, ``delivery``: its deliveries delivered, pending and failed for good), or its
    state and report before."""
    check_id(settlement_id, "settlement_id")
    cur = await db.execute(
        "SELECT board, period, state, report, result, rewards, top_n FROM settlements "
        "WHERE settlement_id = %s",
        (settlement_id,),
    )
    row = await cur.fetchone()
    if row is None:
        raise SettlementNotFound(f"no settlement {settlement_id!r}", "settlement_id")
    board, period, state, report, result, rewards, top_n = row
    if state != "settled":
        return {
            "settlement_id": settlement_id,
            "board": board,
            "period": periods.api_name(period),
            "state": state,
            "rewards": rewards,
            "top_n": top_n,
            "report": report,
        }
    cur = await db.execute(
        "SELECT count(*) FROM settlement_acks JOIN settlement_awards USING (award_id) "
        "WHERE settlement_id = %s",
        (settlement_id,),
    )
    acked = (await cur.fetchone() or (0,))[0]
    out = {**result, "acknowledged": int(acked)}
    if counts and result.get("webhook_url"):  # a count of every delivery: only for those who show it
        out["delivery"] = await delivery_counts(db, settlement_id)
    return out


async def _settled(db: psycopg.AsyncConnection[Any], settlement_id: str) -> None:
    state = (await get(db, settlement_id, counts=False))["state"]
    if state != "settled":
        raise SettlementConflict(
            f"settlement {settlement_id!r} is {state}, not settled: it has no awards yet",
            "settlement_id",
            "not_settled",
        )


async def awards(
    db: psycopg.AsyncConnection[Any], settlement_id: str, after: str | None, limit: int
) -> dict[str, Any]:
    """A page of the awards not acknowledged yet, by rank, after the cursor ``after``."""
    start = 0
    if after is not None:  # checked first: a bad request is 422 whether the settlement exists or not
        if not (after.isascii() and after.isdigit()) or len(after) > CURSOR_DIGITS:
            raise InvalidInput("after must be a cursor from a previous page", "after", "invalid_cursor")
        start = int(after)
    await _settled(db, settlement_id)
    cur = await db.execute(
        "SELECT a.award_id, a.rank, a.player_id, a.points, a.reward FROM settlement_awards a "
        "LEFT JOIN settlement_acks k USING (award_id) "
        "WHERE a.settlement_id = %s AND a.rank > %s AND k.award_id IS NULL ORDER BY a.rank LIMIT %s",
        (settlement_id, start, limit + 1),
    )
    rows = await cur.fetchall()
    page = [
        {"award_id": str(award_id), "rank": rank, "player_id": player, "points": points, "reward": reward}
        for award_id, rank, player, points, reward in rows[:limit]
    ]
    return {
        "settlement_id": settlement_id,
        "awards": page,
        "next": str(page[-1]["rank"]) if len(rows) > limit else None,
    }


async def ack(db: psycopg.AsyncConnection[Any], settlement_id: str, award_ids: object) -> dict[str, Any]:
    """Acknowledge paid awards: every id must be an award of this settlement (else 422 and nothing
    is written); acknowledging one twice is harmless."""
    if not isinstance(award_ids, list) or not award_ids or len(award_ids) > MAX_ACK:
        raise InvalidInput(f"award_ids must be a list of 1 to {MAX_ACK} award ids", "award_ids")
    ids: list[int] = []
    for i, value in enumerate(award_ids):
        if not isinstance(value, str) or not (value.isascii() and value.isdigit()) or len(value) > 19:
            raise InvalidInput("an award id is a string of digits", f"award_ids[{i}]", "invalid_award_id")
        ids.append(int(value))
    await _settled(db, settlement_id)
    async with db.transaction():
        cur = await db.execute(
            "SELECT award_id FROM settlement_awards WHERE settlement_id = %s AND award_id = ANY(%s)",
            (settlement_id, ids),
        )
        known = {row[0] for row in await cur.fetchall()}
        missing = [i for i, value in enumerate(ids) if value not in known]
        if missing:
            raise InvalidInput(
                f"award {award_ids[missing[0]]} is not an award of settlement {settlement_id!r}",
                f"award_ids[{missing[0]}]",
                "unknown_award",
            )
        cur = await db.execute(
            "INSERT INTO settlement_acks (award_id) SELECT unnest(%s::bigint[]) ON CONFLICT DO NOTHING "
            "RETURNING award_id",
            (sorted(set(ids)),),
        )
        new = len(await cur.fetchall())
    return {"settlement_id": settlement_id, "acknowledged": new, "already": len(set(ids)) - new}


def backoff(failures: int, base_s: float = BASE_S, cap_s: float = MAX_BACKOFF_S) -> float:
    """Seconds before the next attempt of a delivery that has failed ``failures`` times (1 or more):
    ``base_s`` doubling, at most ``cap_s``. Tests scale both down to run the schedule in a second."""
    return float(min(cap_s, base_s * 2 ** max(0, failures - 1)))


def _require_secret(secret: str) -> None:
    if not secret:
        raise SettlementConflict(
            "webhook deliveries are signed: set SHARDLB_WEBHOOK_SECRET to send them",
            None,
            "webhook_not_configured",
        )


async def _claim(
    db: psycopg.AsyncConnection[Any], settlement_id: str, lease_s: float, claimed: list[tuple[Any, ...]]
) -> None:
    """Put in ``claimed`` up to CLAIM due rows, by rank, leased: their ``next_at`` (returned: the
    claim's token) pushed ``lease_s`` ahead in the claiming transaction, and rows another deliverer
    holds skipped. The rows are in ``claimed`` before the commit: a round cancelled while it commits
    (psycopg waits for the COMMIT's end, then raises) gives them back all the same."""
    async with db.transaction():
        cur = await db.execute(
            "WITH due AS (SELECT d.award_id FROM settlement_deliveries d JOIN settlement_awards a "
            "USING (award_id) WHERE a.settlement_id = %s AND d.delivered_at IS NULL AND d.attempts < %s "
            "AND d.next_at <= now() ORDER BY d.next_at, a.rank LIMIT %s FOR UPDATE OF d SKIP LOCKED) "
            "UPDATE settlement_deliveries d SET next_at = now() + make_interval(secs => %s) "
            "FROM due, settlement_awards a, settlements s WHERE d.award_id = due.award_id "
            "AND a.award_id = d.award_id AND s.settlement_id = a.settlement_id "
            "RETURNING d.award_id, d.url, d.attempts, d.next_at, a.rank, a.player_id, a.points, a.reward, "
            "s.board, s.period",
            (settlement_id, MAX_ATTEMPTS, CLAIM, lease_s),
        )
        claimed.extend(sorted((tuple(row) for row in await cur.fetchall()), key=lambda row: row[4]))


async def deliver(
    db: psycopg.AsyncConnection[Any],
    http: httpx.AsyncClient,
    secret: str,
    settlement_id: str,
    base_s: float = BASE_S,
    cap_s: float = MAX_BACKOFF_S,
    lease_s: float = LEASE_S,
) -> tuple[int, float | None]:
    """Claim up to CLAIM due deliveries of a settlement and POST each once; return (delivered now,
    seconds until the next one is due, or None when none is left to try)."""
    _require_secret(secret)
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def send(row: tuple[Any, ...]) -> str | None:
        """None when the receiver took it, else why not."""
        award_id, url, _, _, rank, player, points, reward, board, period = row
        body = orjson.dumps(
            {
                "award_id": str(award_id),
                "settlement_id": settlement_id,
                "board": board,
                "period": periods.api_name(period),
                "player_id": player,
                "rank": rank,
                "points": points,
                "reward": reward,
            }
        )
        headers = {
            "content-type": "application/json",
            "idempotency-key": str(award_id),
            SIGNATURE: signature(secret, body),
        }
        async with gate:
            try:
                async with (
                    asyncio.timeout(TIMEOUT_S),
                    http.stream("POST", url, content=body, headers=headers, timeout=TIMEOUT_S) as answer,
                ):
                    status = answer.status_code  # its body is never read (module docstring)
            except (httpx.HTTPError, TimeoutError) as e:  # the receiver is down, slow or unreachable
                return f"{type(e).__name__}: {e}"[:500]
            except Exception as e:  # a URL stored before it was checked, or a bug: one failed attempt
                error = f"{type(e).__name__}: {e}"[:500]
                fields = {"settlement": settlement_id, "award_id": str(award_id), "error": error}
                log.warning("webhook delivery raised: a failed attempt", extra={"fields": fields})
                return error
        return None if 200 <= status < 300 else f"HTTP {status}"

    claimed: list[tuple[Any, ...]] = []
    answers: dict[int, str | None] = {}

    async def attempt(row: tuple[Any, ...]) -> None:
        answers[row[0]] = await send(row)

    try:
        await _claim(db, settlement_id, lease_s, claimed)
        await asyncio.gather(*(attempt(row) for row in claimed))
        await _record(db, claimed, answers, base_s, cap_s)
    except asyncio.CancelledError:
        # Replaced by a new request for the settlement, or its process stops (a router, an
        # archiver's sweep, `shardlb settle` interrupted). Cancelled as its claim commits, it has
        # the rows (``_claim``) and posted none; in the posts, the gather has waited for them to
        # be cut off; as it records, its record has rolled back or committed. So none of this
        # round is in flight any more: record the answers it has and give the rest back, or the
        # next deliverer waits out the lease. Each step holds only under the round's lease (a
        # claim rolled back, a record already made: nothing to do), so running it again is safe.
        if claimed:
            with contextlib.suppress(psycopg.Error, OSError):  # a broken connection: the lease ends
                await _record(db, claimed, answers, base_s, cap_s)
        raise
    cur = await db.execute(  # greatest: an interval has no room for a row due since '-infinity'
        "SELECT extract(epoch FROM min(greatest(d.next_at, now())) - now()) FROM settlement_deliveries d "
        f"JOIN settlement_awards a USING (award_id) WHERE a.settlement_id = %s AND {PENDING}",
        (settlement_id, MAX_ATTEMPTS),
    )
    wait = (await cur.fetchone() or (None,))[0]
    delivered = sum(answers.get(row[0], "") is None for row in claimed)
    return delivered, None if wait is None else float(wait)


async def _record(
    db: psycopg.AsyncConnection[Any],
    claimed: list[tuple[Any, ...]],
    answers: dict[int, str | None],
    base_s: float,
    cap_s: float,
) -> None:
    """A round's outcome: each row of ``claimed`` answered 2xx (None in ``answers``) delivered, each
    answered otherwise a failed attempt, and each not answered at all (its post cut off by a
    cancellation) due again now, with no attempt counted."""
    delivered = [row[0] for row in claimed if row[0] in answers and answers[row[0]] is None]
    failed = [(row, answers[row[0]]) for row in claimed if answers.get(row[0]) is not None]
    unsent = [row for row in claimed if row[0] not in answers]
    async with db.transaction():
        await db.execute(  # delivered is a fact, whoever holds the row now
            "UPDATE settlement_deliveries SET delivered_at = now(), attempts = attempts + 1 "
            "WHERE award_id = ANY(%s) AND delivered_at IS NULL",
            (delivered,),
        )
        # A failure counts only under this round's lease (not taken over since). One past its last
        # attempt is due never ('infinity'), out of the sweep's index range, until retry_failed.
        await db.execute(
            "UPDATE settlement_deliveries d SET attempts = d.attempts + 1, last_error = f.error, "
            "next_at = CASE WHEN d.attempts + 1 >= %s THEN 'infinity'::timestamptz "
            "ELSE now() + make_interval(secs => f.wait) END FROM unnest(%s::bigint[], %s::text[], "
            "%s::float8[], %s::timestamptz[]) AS f(award_id, error, wait, lease) "
            "WHERE d.award_id = f.award_id AND d.next_at = f.lease AND d.delivered_at IS NULL",
            (
                MAX_ATTEMPTS,
                [row[0] for row, _ in failed],
                [error for _, error in failed],
                [backoff(row[2] + 1, base_s, cap_s) for row, _ in failed],
                [row[3] for row, _ in failed],
            ),
        )
        if unsent:  # given back under the same rule: only a row this round still holds
            await db.execute(
                "UPDATE settlement_deliveries d SET next_at = now() "
                "FROM unnest(%s::bigint[], %s::timestamptz[]) AS f(award_id, lease) "
                "WHERE d.award_id = f.award_id AND d.next_at = f.lease AND d.delivered_at IS NULL",
                ([row[0] for row in unsent], [row[3] for row in unsent]),
            )


async def retry_failed(db: psycopg.AsyncConnection[Any], settlement_id: str) -> int:
    """Give the settlement's deliveries that failed for good (every attempt used) a new schedule,
    due now; return how many."""
    cur = await db.execute(
        "UPDATE settlement_deliveries d SET attempts = 0, next_at = now() FROM settlement_awards a "
        "WHERE a.award_id = d.award_id AND a.settlement_id = %s AND d.delivered_at IS NULL "
        f"AND NOT ({PENDING})",
        (settlement_id, MAX_ATTEMPTS),
    )
    return cur.rowcount


async def deliver_until_done(
    db: psycopg.AsyncConnection[Any],
    secret: str,
    settlement_id: str,
    deadline_s: float | None = None,
    base_s: float = BASE_S,
    cap_s: float = MAX_BACKOFF_S,
) -> dict[str, int]:
    """Give what failed for good a new schedule (``retry_failed``), then ``deliver`` again and
    again, sleeping until the next one is due, until none is left to try or ``deadline_s`` passes
    (None: no deadline); return the delivery counts."""
    _require_secret(secret)
    end = None if deadline_s is None else time.monotonic() + deadline_s
    await retry_failed(db, settlement_id)
    async with httpx.AsyncClient() as http:
        while True:
            _, wait = await deliver(db, http, secret, settlement_id, base_s, cap_s)
            if wait is None or (end is not None and time.monotonic() + wait > end):
                break
            await asyncio.sleep(max(wait, 0.01))
    return await delivery_counts(db, settlement_id)


async def due_settlements(db: psycopg.AsyncConnection[Any]) -> list[str]:
    """Every settlement with deliveries due now, the longest due first: all due rows are read
    (through the partial index on ``next_at``; delivered rows and those past their last attempt,
    due 'infinity', are out of its range), so a big settlement whose receiver is down cannot hide
    the others, as a window of the 1000 oldest due rows did."""
    try:
        cur = await db.execute(
            "SELECT a.settlement_id FROM settlement_deliveries d JOIN settlement_awards a USING (award_id) "
            "WHERE d.delivered_at IS NULL AND d.next_at <= now() AND d.attempts < %s "
            "GROUP BY a.settlement_id ORDER BY min(d.next_at)",
            (MAX_ATTEMPTS,),
        )
    except psycopg.errors.UndefinedTable:  # nothing was ever settled against this database
        return []
    return [str(row[0]) for row in await cur.fetchall()]


async def sweep(
    db: psycopg.AsyncConnection[Any],
    http: httpx.AsyncClient,
    secret: str,
    base_s: float = BASE_S,
    cap_s: float = MAX_BACKOFF_S,
) -> int:
    """``deliver`` rounds for every settlement with deliveries due now, each while it has rows due
    and for at most SWEEP_BUDGET_S; returns how many were delivered. Rows another deliverer holds
    are skipped by the claims, so it never posts one that a router's task is posting."""
    done = 0
    for settlement_id in await due_settlements(db):
        end = time.monotonic() + SWEEP_BUDGET_S
        while True:
            delivered, wait = await deliver(db, http, secret, settlement_id, base_s, cap_s)
            done += delivered
            if wait is None or wait > 0 or time.monotonic() > end:
                break
    return done


async def sweep_forever(
    postgres_url: str,
    secret: str,
    stop: asyncio.Event,
    every_s: float = SWEEP_EVERY_S,
    base_s: float = BASE_S,
    cap_s: float = MAX_BACKOFF_S,
) -> None:
    """``sweep`` every ``every_s`` until ``stop`` is set, on a connection of its own, reconnecting
    after any failure of PostgreSQL or of a round (logged as an Outage; the rows stay due meanwhile)."""
    _require_secret(secret)
    db: psycopg.AsyncConnection[Any] | None = None
    outage = Outage(log, "webhook sweep failed; retrying", "webhook sweep works again")
    async with httpx.AsyncClient() as http:
        try:
            while not stop.is_set():
                try:
                    if db is None or db.closed:
                        db = await psycopg.AsyncConnection.connect(
                            postgres_url,
                            autocommit=True,
                            application_name="shardlb-webhooks",
                            **pgconn.options(postgres_url),
                        )
                    done = await sweep(db, http, secret, base_s, cap_s)
                except (psycopg.Error, OSError) as e:
                    outage.failed(e)
                    if db is not None:
                        await db.close()
                        db = None
                else:
                    outage.succeeded()
                    if done:
                        log.info("webhook deliveries swept", extra={"fields": {"delivered": done}})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), every_s)
        finally:
            if db is not None:
                await db.close()


async def delivery_counts(db: psycopg.AsyncConnection[Any], settlement_id: str) -> dict[str, int]:
    """Deliveries delivered, pending (attempts left) and failed for good (none left)."""
    cur = await db.execute(
        "SELECT count(*) FILTER (WHERE d.delivered_at IS NOT NULL), "
        f"count(*) FILTER (WHERE {PENDING}), "
        f"count(*) FILTER (WHERE d.delivered_at IS NULL AND NOT ({PENDING})) "
        "FROM settlement_deliveries d JOIN settlement_awards a USING (award_id) WHERE a.settlement_id = %s",
        (MAX_ATTEMPTS, MAX_ATTEMPTS, settlement_id),
    )
    delivered, pending, failed = await cur.fetchone() or (0, 0, 0)
    return {"delivered": int(delivered), "pending": int(pending), "failed": int(failed)}


async def deliver_all(
    postgres_url: str, secret: str, settlement_id: str, deadline_s: float | None = None
) -> dict[str, int]:
    """``deliver_until_done`` on a connection of its own (the router's task, `shardlb settle`)."""
    settings = pgconn.options(postgres_url)
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True, **settings) as db:
        return await deliver_until_done(db, secret, settlement_id, deadline_s)
