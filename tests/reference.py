"""A plain in-memory board: the reference every ranking test compares the cluster with.

It knows nothing of shards, keys or Lua. Each period is a dict player -> (points, time units); the
order is a sorted Python list by (score, player) descending, the documented total order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlb import periods
from shardlb.board import MAX_FUTURE_MS, Score
from shardlb.codec import ScoreCodec
from shardlb.config import BoardConfig


def added(old: tuple[int, int] | None, points: int, units: int) -> tuple[int, int]:
    """An incr entry (sum, time units) after a result: the sum, at the latest time among the results
    that scored; a player with nothing scored yet is at the earliest of their results (0 points)."""
    if old is None or (points > 0 and old[0] == 0):
        return points, units
    if points > 0:
        return old[0] + points, max(old[1], units)
    return old if old[0] > 0 else (0, min(old[1], units))


@dataclass
class ReferenceBoard:
    config: BoardConfig
    boards: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    seen: set[tuple[str, str]] = field(default_factory=set)
    region_of: dict[str, str] = field(default_factory=dict)  # player -> the region of their total
    # (period, player) -> the region of that entry: a removal that kept some periods (``remove``'s
    # ``request``) can leave a player's period entries in a region their total has left since
    where: dict[tuple[str, str], str] = field(default_factory=dict)
    frozen: set[str] = field(default_factory=set)  # period names frozen (Board.freeze)
    closed: list[tuple[str, ...]] = field(default_factory=list)  # per score of the last submit: API names
    removed: dict[str, int] = field(default_factory=dict)  # player -> time units of their removal
    # request -> (the time units of its first call that reached a player, the players it reached,
    # those of them it found with an entry): ``remove``
    requests: dict[str, tuple[int, set[str], set[str]]] = field(default_factory=dict)

    @property
    def codec(self) -> ScoreCodec:
        return self.config.codec()

    def submit(self, scores: list[Score], now_ms: int) -> list[tuple[str, int]]:
        """Apply in order; return (status, total points after) per score."""
        codec, tz, c = self.codec, periods.zone(self.config.timezone), self.config
        out = []
        self.closed = []
        for s in scores:
            achieved = now_ms if s.achieved_ms is None else s.achieved_ms
            units = codec.time_units(achieved)
            names = periods.names_at(codec.units_to_ms(units), c.periods, tz, c.week_start)

            # A closed or frozen period takes nothing; the result counts in the others. A period
            # closes at its end plus the grace, or plus its retention when shorter.
            def closes(n: str) -> int:
                kept = c.retention_days[periods.first_day(n)[0]]
                return periods.closes_ms(n, tz, c.close_grace_s, c.week_start, kept)

            shut = [n for n in names[1:] if n in self.frozen or now_ms >= closes(n)]
            names = [n for n in names if n not in shut]
            total = self.boards.setdefault("total", {})
            before = total.get(s.player_id)
            status = "unchanged"
            # A player's first region sticks: a result under another is refused, nothing written,
            # where that region holds the player in a period of the result (the total, or a period
            # entry a removal kept when it took the total).
            if s.region is not None and any(
                s.player_id in self.boards.get(n, {}) and self.where.get((n, s.player_id)) != s.region
                for n in names
            ):
                status = "region_conflict"
            elif units < self.removed.get(s.player_id, -1):
                status = "duplicate"  # achieved before the player's removal: nothing is written
            elif self.config.mode == "incr":
                if (s.match_id, s.player_id) in self.seen:
                    status = "duplicate"
                else:
                    news = {
                        name: added(self.boards.setdefault(name, {}).get(s.player_id), s.points, units)
                        for name in names
                    }
                    if news["total"][0] > codec.points_max:
                        status = "overflow"
                    else:
                        self.seen.add((s.match_id, s.player_id))
                        for name, value in news.items():
                            self.boards[name][s.player_id] = value
                        status = "unchanged" if news["total"] == before else "improved"
            else:
                new = codec.encode_units(s.points, units)
                for name in names:
                    board = self.boards.setdefault(name, {})
                    old = board.get(s.player_id)
                    old_score = None if old is None else codec.encode_units(*old)
                    if self.config.mode == "best":
                        replace = old_score is None or new > old_score
                    else:
                        replace = old is None or units > old[1] or (units == old[1] and new > old_score)
                    if replace:
                        board[s.player_id] = (s.points, units)
                        if name == "total" and new != old_score:
                            status = "improved"
            after = total.get(s.player_id)
            applied = status in ("improved", "unchanged")
            if applied and s.region is not None:
                for name in names:
                    self.where[(name, s.player_id)] = s.region
                if after is not None:
                    self.region_of[s.player_id] = s.region
            out.append((status, after[0] if after else 0))
            self.closed.append(tuple(periods.api_name(n) for n in shut) if applied else ())
        return out

    def remove(self, player: str, at_ms: int | None = None, request: str | None = None) -> bool:
        """The player leaves every period (an incr board's dedup stays); returns whether they had an
        entry. A removal asked for (with its time ``at_ms``; not the inactive cleanup) also refuses
        their results achieved before it (on best and set boards up to 5 minutes past it: a result
        applied before the removal may be dated that far ahead), or at or before the latest of their
        kept results.

        ``request`` names the removal (moderation.remove's): the removal of a player that a call of
        the same request made already changes nothing and answers as it did; one that an earlier
        call of the request did not reach (its shard's call lost) takes the entries achieved before
        the time of that earlier call and keeps the others (results posted since)."""
        first = self.requests.get(request) if request is not None else None
        if first is not None and player in first[1]:
            return player in first[2]
        since = None if first is None else first[0]
        taken = [
            board.pop(player)
            for board in self.boards.values()
            if player in board and (since is None or board[player][1] < since)
        ]
        if player not in self.boards.get("total", {}):
            self.region_of.pop(player, None)
        if at_ms is not None:
            units = self.record_units(at_ms) if since is None else since
            self.removed[player] = max([units, self.removed.get(player, -1), *(u + 1 for _, u in taken)])
            if request is not None:
                reached, removed = self.requests.setdefault(request, (units, set(), set()))[1:]
                reached.add(player)
                if taken:
                    removed.add(player)
        return bool(taken)

    def record_units(self, at_ms: int) -> int:
        """The time (units) before which a removal at ``at_ms`` refuses the player's results."""
        if self.config.mode == "incr":  # its dedup records outlive the removal
            return (at_ms - self.config.epoch_ms) // self.codec.unit_ms
        # A result applied before it may be dated up to MAX_FUTURE_MS past it, and not kept.
        return (at_ms + MAX_FUTURE_MS - self.config.epoch_ms) // self.codec.unit_ms + 1

    def order(self, name: str = "total", region: str | None = None) -> list[tuple[int, str, int, int]]:
        """(score, player, points, units), best first."""
        codec = self.codec
        rows = [
            (codec.encode_units(points, units), player, points, units)
            for player, (points, units) in self.boards.get(name, {}).items()
            if region is None or self.where.get((name, player)) == region
        ]
        return sorted(rows, reverse=True)

    def competition(self, name: str = "total", region: str | None = None) -> dict[str, tuple[int, int]]:
        """Each player's competition rank (1 + the players with strictly better points, whatever
        their time: more points on a desc board, fewer on asc) and how many have strictly worse."""
        listed = [points for _, _, points, _ in self.order(name, region)]
        sign = 1 if self.config.order == "desc" else -1
        return {
            player: (
                1 + sum(sign * other > sign * points for other in listed),
                sum(sign * other < sign * points for other in listed),
            )
            for _, player, points, _ in self.order(name, region)
        }
