"""What the client sends and gets back, as dataclasses: one match result in, and the API's answers out.

Times come back as timezone-aware ``datetime`` values in UTC. Anything the API adds later to a board's
settings stays reachable in ``BoardInfo.settings`` (the body as the server sent it).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class MatchResult:
    """One player's result of one match, as a game server posts it.

    ``match_id`` is required, and must be the same every time the same result is sent: it is what
    makes a retry safe. When a request's answer is lost (a dropped connection, a timeout, a 503 after
    the write was applied), the client cannot know whether the server applied it; sending it again
    under the same ``(match_id, player_id)`` lets the server recognise the replay (``duplicate`` on
    ``incr`` boards, ``unchanged`` or ``duplicate`` on ``best`` ones), whereas a result without an id
    would be counted twice. Use an id your game already has for the match (its UUID), never one made
    up per attempt.

    ``achieved_at`` is an aware ``datetime``, integer epoch milliseconds or an RFC 3339 string; left
    out, the server uses the time the result first arrived (and keeps it for the retries).
    ``region`` is required on region boards and ignored elsewhere.
    """

    player_id: str
    points: int
    match_id: str
    achieved_at: datetime | int | str | None = None
    region: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.match_id, str) or not self.match_id:
            raise ValueError("a MatchResult needs its match id: without one a retry could count it twice")

    def body(self) -> dict[str, Any]:
        """The score as the API spells it."""
        out: dict[str, Any] = {"player_id": self.player_id, "points": self.points, "match_id": self.match_id}
        if self.achieved_at is not None:
            at = self.achieved_at
            out["achieved_at"] = at.isoformat() if isinstance(at, datetime) else at
        if self.region is not None:
            out["region"] = self.region
        return out


@dataclass(frozen=True)
class ScoreOutcome:
    """What the server did with one posted result: ``status`` is ``improved``, ``unchanged``,
    ``duplicate`` (a replay of a result it already has), or one of the router's additions
    (``overflow``, ``region_conflict``); ``points`` is the player's ``total`` after the write.

    After a retry, a result that an earlier attempt had already applied reports ``duplicate`` (or
    ``unchanged``): the board counts it once either way."""

    player_id: str
    match_id: str
    status: str
    points: int
    # Dated periods the result belongs to that had closed when it arrived (it was not counted in
    # them: router/README.md, "Period lifecycle"), as the server names them (``daily:2026-11-30``).
    closed_periods: tuple[str, ...] = ()

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> ScoreOutcome:
        closed = tuple(body.get("closed_periods") or ())
        return cls(body["player_id"], body["match_id"], body["status"], body["points"], closed)


def parse_time(value: str) -> datetime:
    """An RFC 3339 time of the API (always with an offset; Python 3.11 reads ``Z``)."""
    return datetime.fromisoformat(value)


@dataclass(frozen=True)
class Entry:
    """One row of a board: ``rank`` 1 is the best."""

    rank: int
    player_id: str
    points: int
    achieved_at: datetime
    reward: Any = None  # a settled period's reward for this rank (its settlement's table), if any

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Entry:
        at = parse_time(body["achieved_at"])
        return cls(body["rank"], body["player_id"], body["points"], at, body.get("reward"))


def entries_of(body: dict[str, Any]) -> list[Entry]:
    return [Entry.from_body(e) for e in body["entries"]]


@dataclass(frozen=True)
class Page:
    """A slice of a board (``top`` and ``entries``): ``period`` as the server names it (e.g.
    ``daily:2026-11-30`` for ``daily``), ``as_of`` when the rows were read from the cluster."""

    board: str
    period: str
    entries: list[Entry]
    as_of: datetime
    # A settled period is read from its settlement's snapshot: final ranks, with rewards.
    settled: bool = False
    settlement_id: str | None = None
    resets_at: datetime | None = None  # when a dated period closes (absent for ``total``)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Page:
        resets = body.get("resets_at")
        return cls(
            body["board"],
            body["period"],
            entries_of(body),
            parse_time(body["as_of"]),
            bool(body.get("settled", False)),
            body.get("settlement_id"),
            None if resets is None else parse_time(resets),
        )


@dataclass(frozen=True)
class PlayerRank:
    """A player's place: ``players`` is the board's size, ``percentile`` the share of players ranked
    below (0-100). With ``estimate=True``, ``rank_error`` bounds the distance from the exact rank and
    ``as_of`` is the time of the estimate's snapshot; both are None for exact answers. With
    ``max_age_ms``, ``counts_as_of`` is when the counts of the other shards were read."""

    player_id: str
    rank: int
    points: int
    achieved_at: datetime
    players: int
    percentile: float
    rank_error: int | None = None
    as_of: datetime | None = None
    counts_as_of: datetime | None = None
    settled: bool = False  # the final rank of a settled period, from its snapshot
    settlement_id: str | None = None
    reward: Any = None
    resets_at: datetime | None = None

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> PlayerRank:
        as_of, counts_as_of, resets = body.get("as_of"), body.get("counts_as_of"), body.get("resets_at")
        return cls(
            body["player_id"],
            body["rank"],
            body["points"],
            parse_time(body["achieved_at"]),
            body["players"],
            float(body["percentile"]),
            body.get("rank_error"),
            None if as_of is None else parse_time(as_of),
            None if counts_as_of is None else parse_time(counts_as_of),
            bool(body.get("settled", False)),
            body.get("settlement_id"),
            body.get("reward"),
            None if resets is None else parse_time(resets),
        )


# What GET /v1/boards/{board} adds to a board's settings: its state at the time of the read.
_STATE = ("players", "resets_at", "closed")


@dataclass(frozen=True)
class BoardInfo:
    """A board's settings (``settings``: the body's settings, the same from every call). ``players``
    (players per kept period), ``resets_at`` (when each kept dated period's current one ends, RFC
    3339) and ``closed`` (its season's archive closed it: posts raise ``BoardClosed``) are filled by
    ``get_board`` only; ``created`` by ``put_board`` only (True: 201, False: 200)."""

    id: str
    mode: str
    order: str
    periods: list[str]
    sharding: dict[str, Any]
    settings: dict[str, Any]
    players: dict[str, int] | None = None
    created: bool | None = None
    resets_at: dict[str, str] | None = None
    closed: bool | None = None

    @classmethod
    def from_body(cls, body: dict[str, Any], created: bool | None = None) -> BoardInfo:
        settings = {k: v for k, v in body.items() if k not in _STATE}
        return cls(
            body["board"],
            body["mode"],
            body["order"],
            list(body["periods"]),
            dict(body["sharding"]),
            settings,
            body.get("players"),
            created,
            body.get("resets_at"),
            body.get("closed"),
        )
