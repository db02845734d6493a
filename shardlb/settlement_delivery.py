"""Awards delivery: a settlement read back, its awards paged and acknowledged, and the webhook.

A game server pays awards by paging ``awards`` (a cursor on the rank; acknowledged awards are left
out, so a page read again after an ack offers only what is still unpaid) and acknowledging the
award ids it paid; an ack is idempotent and all or nothing.

The webhook is at-least-once: the settlement's transaction writes one ``settlement_deliveries`` row
per award; ``deliver`` POSTs each due row, marks it delivered on a 2xx, and otherwise sets its next
attempt after an exponential backoff (``BASE_S`` doubling up to ``MAX_BACKOFF_S``, ``MAX_ATTEMPTS``
in all). A delivery answered 2xx whose mark is lost (a crash right then) is sent again: receivers
deduplicate on the ``Idempotency-Key`` header, the award id. The body is signed with HMAC-SHA256
over its exact bytes under SHARDLB_WEBHOOK_SECRET (header ``X-Shardlb-Signature: sha256=<hex>``).
Deliveries left due when a process stops are sent by the next ``deliver`` of that settlement (the
same settle request or `shardlb settle` run again, which returns the stored result and delivers).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Sequence
from typing import Any

import httpx
import orjson
import psycopg

from shardlb import periods
from shardlb.config import check_id
from shardlb.errors import InvalidInput, SettlementConflict, SettlementNotFound

MAX_ATTEMPTS = 8
BASE_S = 1.0
MAX_BACKOFF_S = 300.0
TIMEOUT_S = 10.0
IN_FLIGHT = 8  # webhook POSTs at once
SIGNATURE = "X-Shardlb-Signature"
MAX_ACK = 1000


def signature(secret: str, body: bytes) -> str:
    """The signature header's value for ``body`` (what a receiver recomputes and compares)."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


async def get(db: psycopg.AsyncConnection[Any], settlement_id: str) -> dict[str, Any]:
    """The settlement as stored: its result once settled (with the count acknowledged so far), or
    its state and report before."""
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
    return {**result, "acknowledged": int(acked)}


async def _settled(db: psycopg.AsyncConnection[Any], settlement_id: str) -> None:
    state = (await get(db, settlement_id))["state"]
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
        if not (after.isascii() and after.isdigit()) or len(after) > 12:
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


def backoff(attempts: int, base_s: float = BASE_S) -> float:
    """Seconds before attempt ``attempts + 1`` (after ``attempts`` failures)."""
    return float(min(MAX_BACKOFF_S, base_s * 2 ** max(0, attempts - 1)))


async def deliver(
    db: psycopg.AsyncConnection[Any],
    http: httpx.AsyncClient,
    secret: str,
    settlement_id: str,
    base_s: float = BASE_S,
) -> tuple[int, float | None]:
    """POST every due delivery of a settlement once; return (delivered now, seconds until the next
    one is due, or None when none is left to try)."""
    cur = await db.execute(
        "SELECT d.award_id, d.url, d.attempts, a.rank, a.player_id, a.points, a.reward, s.board, s.period "
        "FROM settlement_deliveries d JOIN settlement_awards a USING (award_id) "
        "JOIN settlements s USING (settlement_id) "
        "WHERE a.settlement_id = %s AND d.delivered_at IS NULL AND d.attempts < %s AND d.next_at <= now() "
        "ORDER BY a.rank LIMIT 500",
        (settlement_id, MAX_ATTEMPTS),
    )
    due = await cur.fetchall()
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def send(row: Sequence[Any]) -> tuple[int, int, str | None]:
        award_id, url, attempts, rank, player, points, reward, board, period = row
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
                answer = await http.post(url, content=body, headers=headers, timeout=TIMEOUT_S)
            except httpx.HTTPError as e:
                return award_id, attempts, f"{type(e).__name__}: {e}"[:500]
        if 200 <= answer.status_code < 300:
            return award_id, attempts, None
        return award_id, attempts, f"HTTP {answer.status_code}"

    sent = await asyncio.gather(*(send(row) for row in due))
    async with db.transaction():
        for award_id, attempts, error in sent:
            if error is None:
                await db.execute(
                    "UPDATE settlement_deliveries SET delivered_at = now(), attempts = attempts + 1 "
                    "WHERE award_id = %s",
                    (award_id,),
                )
            else:
                await db.execute(
                    "UPDATE settlement_deliveries SET attempts = attempts + 1, last_error = %s, "
                    "next_at = now() + make_interval(secs => %s) WHERE award_id = %s",
                    (error, backoff(attempts + 1, base_s), award_id),
                )
    cur = await db.execute(
        "SELECT extract(epoch FROM min(d.next_at) - now()) FROM settlement_deliveries d "
        "JOIN settlement_awards a USING (award_id) "
        "WHERE a.settlement_id = %s AND d.delivered_at IS NULL AND d.attempts < %s",
        (settlement_id, MAX_ATTEMPTS),
    )
    wait = (await cur.fetchone() or (None,))[0]
    return sum(error is None for _, _, error in sent), None if wait is None else max(0.0, float(wait))


async def deliver_until_done(
    db: psycopg.AsyncConnection[Any],
    secret: str,
    settlement_id: str,
    deadline_s: float = 3600.0,
    base_s: float = BASE_S,
) -> dict[str, int]:
    """``deliver`` again and again, sleeping until the next one is due, until none is left to try
    or ``deadline_s`` passes; return the delivery counts."""
    end = time.monotonic() + deadline_s
    async with httpx.AsyncClient() as http:
        while True:
            _, wait = await deliver(db, http, secret, settlement_id, base_s)
            if wait is None or time.monotonic() + wait > end:
                break
            await asyncio.sleep(max(wait, 0.01))
    return await delivery_counts(db, settlement_id)


async def delivery_counts(db: psycopg.AsyncConnection[Any], settlement_id: str) -> dict[str, int]:
    cur = await db.execute(
        "SELECT count(*) FILTER (WHERE delivered_at IS NOT NULL), "
        "count(*) FILTER (WHERE delivered_at IS NULL AND attempts < %s), "
        "count(*) FILTER (WHERE delivered_at IS NULL AND attempts >= %s) "
        "FROM settlement_deliveries JOIN settlement_awards USING (award_id) WHERE settlement_id = %s",
        (MAX_ATTEMPTS, MAX_ATTEMPTS, settlement_id),
    )
    delivered, pending, failed = await cur.fetchone() or (0, 0, 0)
    return {"delivered": int(delivered), "pending": int(pending), "failed": int(failed)}


async def deliver_all(
    postgres_url: str, secret: str, settlement_id: str, deadline_s: float = 3600.0
) -> dict[str, int]:
    """``deliver_until_done`` on a connection of its own (`shardlb settle --webhook`)."""
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as db:
        return await deliver_until_done(db, secret, settlement_id, deadline_s)
