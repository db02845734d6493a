"""Reconcile: does each shard of a board in Redis hold what PostgreSQL (with the journal) says?

Per shard and for one period board, both sides are reduced to a member count and an order-free
checksum: the sum, modulo 2**64, of a 64-bit hash of each (player, encoded score). PostgreSQL's side
is the rebuild's snapshot (shardlb/rebuild.py): the archived rows plus the journal's entries not yet
archived, up to the journal's position X, folded by the board's rule. Redis's side is read with
ZSCAN after X. Players written between X and the end of the read (the journal says which) are left
out of both sides, and counted as ``busy``: a reconcile needs no pause in the writes. On a band
board the band shards are checked against the totals PostgreSQL gives, grouped by band.

``--repair`` rebuilds the shards that drift (shardlb/rebuild.py), and nothing else. Both are refused
while the board is resharded, or rebuilt after a loss of Redis (``Rebuilder.check_layout``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

from shardlb import keys, periods, times
from shardlb.board import Board
from shardlb.errors import BoardConflict
from shardlb.rebuild import Fold, Mark, Rebuilder, ShardReport, parse_id, wanted_periods

MASK = 2**64 - 1


def checksum(members: Mapping[str, int]) -> int:
    """The order-free checksum of a board's (player, encoded score) pairs."""
    total = 0
    for player, score in members.items():
        digest = hashlib.blake2b(f"{player}\x00{score}".encode(), digest_size=8).digest()
        total += int.from_bytes(digest, "big")
    return total & MASK


@dataclass(frozen=True)
class ShardCheck:
    shard: int
    redis_players: int
    postgres_players: int
    redis_sum: int
    postgres_sum: int
    busy: int  # players written during the check, left out of both sides

    @property
    def drift(self) -> bool:
        return (self.redis_players, self.redis_sum) != (self.postgres_players, self.postgres_sum)


def _check(shard: int, redis: dict[str, int], postgres: dict[str, int], busy: set[str]) -> ShardCheck:
    left = {p: s for p, s in redis.items() if p not in busy}
    right = {p: s for p, s in postgres.items() if p not in busy}
    return ShardCheck(shard, len(left), len(right), checksum(left), checksum(right), len(busy))


async def reconcile(rebuilder: Rebuilder, board: Board, period: str = "total") -> list[ShardCheck]:
    """Compare every shard of ``board`` for one API period (``total``, ``daily``, ``daily:2026-11-30``...)."""
    if board.config.durability != "journal":
        raise BoardConflict(f"board {board.config.id!r} keeps no journal (durability memory)", "board")
    # During a reshard the archived rows are filed under the old layout's shards: every shard would
    # show drift that is not there. Refused, as a rebuild is, until the reshard is over; and while
    # shards emptied by a loss of Redis are not rebuilt yet (docs/design-notes.md, "A board being
    # rebuilt"): the rebuild under way mends them, a repair would only write beside it.
    await rebuilder.check_layout(board, "reconcile")
    now = times.now_ms()
    name = periods.parse(period, board.config.periods, board.tz, now, board.config.week_start)
    wanted = wanted_periods(board, name, now)
    homes = range(board.config.sharding.shards)
    checks: list[ShardCheck] = []
    marks: dict[int, Mark] = {}
    expected_totals: dict[str, int] = {}
    for home in homes:
        prefix = board.prefixes[home]
        fold = Fold(board, wanted)
        snap = await rebuilder.snapshot(board, home, fold)
        marks[home] = snap.mark
        expected = fold.scores(name)
        actual = await rebuilder.members(keys.period_key(prefix, name))
        busy = await _written_since(rebuilder, board, home, snap.mark)
        checks.append(_check(home, actual, expected, busy))
        expected_totals.update(expected)
    if board.layout.strategy == "band" and name == "total":
        checks += await _bands(rebuilder, board, expected_totals, marks)
    return checks


async def _written_since(rebuilder: Rebuilder, board: Board, shard: int, mark: Mark) -> set[str]:
    """The players ``shard``'s journal names after ``mark`` (results and removals)."""
    now = await rebuilder.mark(board.prefixes[shard])
    if now.last == mark.last:
        return set()
    new, removed = await rebuilder.changes(board, shard, mark.position, parse_id(now.last))
    return {r.player_id for r in new} | set(removed)


async def _bands(
    rebuilder: Rebuilder, board: Board, totals: dict[str, int], marks: dict[int, Mark]
) -> list[ShardCheck]:
    """The band shards against PostgreSQL's totals; players written since the homes were read, or
    with a band move not yet finished (shardlb/bands.py), are busy."""
    layout, codec = board.layout, board.codec
    expected: dict[int, dict[str, int]] = {
        s: {} for s in range(board.config.sharding.shards, layout.physical)
    }
    for player, score in totals.items():
        expected[layout.band_shard(codec.decode_units(score)[0])][player] = score
    actual = {s: await rebuilder.members(keys.period_key(board.prefixes[s], "total")) for s in expected}
    busy: set[str] = set()
    for home, mark in marks.items():
        busy |= await _written_since(rebuilder, board, home, mark)
        pending = await rebuilder.client.hkeys(keys.pending_key(board.prefixes[home]))
        busy |= {p.decode() if isinstance(p, bytes) else str(p) for p in pending}
    return [_check(s, actual[s], expected[s], busy) for s in expected]


async def repair(
    rebuilder: Rebuilder, board: Board, checks: list[ShardCheck], period: str = "total"
) -> list[ShardReport]:
    """Rebuild the shards that drift (a band board's band shards all at once: they are rebuilt
    together from the totals, and after any home shard of the total). Refused, as ``reconcile``
    is, while the board is being rebuilt after a loss of Redis."""
    await rebuilder.check_layout(board, "reconcile")
    homes = range(board.config.sharding.shards)
    drifting = [c.shard for c in checks if c.drift]
    reports = []
    for shard in (s for s in drifting if s in homes):
        reports += await rebuilder.rebuild(board, period, shard)
    if any(s not in homes for s in drifting) and not any(s in homes for s in drifting):
        reports += await rebuilder.rebuild_bands(board)
    return reports


def table(checks: list[ShardCheck]) -> str:
    """The comparison as the command prints it."""
    head = ("shard", "redis", "postgres", "redis sum", "postgres sum", "busy")
    lines = ["{:>5}  {:>9}  {:>9}  {:>16}  {:>16}  {:>5}  state".format(*head)]
    for c in checks:
        lines.append(
            f"{c.shard:>5}  {c.redis_players:>9}  {c.postgres_players:>9}  {c.redis_sum:016x}  "
            f"{c.postgres_sum:016x}  {c.busy:>5}  {'DRIFT' if c.drift else 'ok'}"
        )
    return "\n".join(lines)


def write_metrics(path: Path, board: Board, found: Mapping[str, list[ShardCheck]]) -> None:
    """The last result as Prometheus text (for node_exporter's textfile collector, or a Pushgateway
    job), per API period checked: shards drifting, shards checked, players left out as busy, and when."""
    registry = CollectorRegistry()
    labels = ["board", "period"]
    gauges = {
        "shardlb_reconcile_drifting_shards": "Shards whose Redis board differs from PostgreSQL.",
        "shardlb_reconcile_shards": "Shards compared.",
        "shardlb_reconcile_busy_players": "Players left out: written to during the check.",
        "shardlb_reconcile_last_run_timestamp_seconds": "When the last reconcile finished.",
    }
    made = {metric: Gauge(metric, text, labels, registry=registry) for metric, text in gauges.items()}
    for period, checks in found.items():
        values = {
            "shardlb_reconcile_drifting_shards": sum(c.drift for c in checks),
            "shardlb_reconcile_shards": len(checks),
            "shardlb_reconcile_busy_players": sum(c.busy for c in checks),
            "shardlb_reconcile_last_run_timestamp_seconds": time.time(),
        }
        for metric, value in values.items():
            made[metric].labels(board.config.id, period).set(value)
    write_to_textfile(str(path), registry)
