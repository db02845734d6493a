"""What the client sends and gets back, as dataclasses: one match result in, and the API's answers out.

Times come back as timezone-aware ``datetime`` values in UTC. Anything the API adds later to a board's
settings stays reachable in ``BoardInfo.settings`` (the body as the server sent it).

The answers are read with the types api.md gives them: a field missing or of another type is a
``MalformedBody`` naming it (the client raises it as ``MalformedAnswer``), never a KeyError or a
value of the wrong type left in a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any


class MalformedBody(ValueError):
    """An answer's body that the models cannot read. The message names the field at fault by its
    path in the body: ``entries[3].achieved_at is missing``."""


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


class _Fields:
    """One object of an answer, read field by field with the types the models need. ``where`` is
    the object's path in the answer (empty for the answer itself)."""

    def __init__(self, body: Any, where: str = "") -> None:
        if not isinstance(body, dict):
            if body is None and not where:
                raise MalformedBody("the answer has no body")
            raise MalformedBody(f"{where or 'the answer'} is not an object (got {_kind(body)})")
        self.body = body
        self.where = where

    def path(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def _get(self, name: str, kinds: type | tuple[type, ...], what: str, optional: bool) -> Any:
        if name not in self.body and not optional:
            raise MalformedBody(f"{self.path(name)} is missing")
        value = self.body.get(name)
        if value is None and optional:
            return None
        # bool is an int to Python, not to JSON: true is no rank
        if not isinstance(value, kinds) or (isinstance(value, bool) and kinds is not bool):
            raise MalformedBody(f"{self.path(name)} is not {what} (got {_kind(value)})")
        return value

    def text(self, name: str, optional: bool = False) -> Any:
        return self._get(name, str, "a string", optional)

    def integer(self, name: str, optional: bool = False) -> Any:
        return self._get(name, int, "an integer", optional)

    def number(self, name: str) -> float:
        return float(self._get(name, (int, float), "a number", False))

    def flag(self, name: str, absent: bool | None = False) -> Any:
        """An optional boolean, ``absent`` when the answer leaves it out."""
        value = self._get(name, bool, "a boolean", True)
        return absent if value is None else value

    def mapping(self, name: str, optional: bool = False) -> Any:
        return self._get(name, dict, "an object", optional)

    def counts(self, name: str) -> dict[str, int] | None:
        """An optional object of integers (players per period)."""
        found = self.mapping(name, optional=True)
        if found is None:
            return None
        inner = _Fields(found, self.path(name))
        return {key: inner.integer(key) for key in found}

    def times_by_name(self, name: str) -> dict[str, str] | None:
        """An optional object of RFC 3339 times, kept as the server spelt them."""
        found = self.mapping(name, optional=True)
        if found is None:
            return None
        inner = _Fields(found, self.path(name))
        for key in found:
            inner.time(key)
        return dict(found)

    def texts(self, name: str, optional: bool = False) -> list[str]:
        values = self._get(name, list, "a list", optional) or []
        for i, value in enumerate(values):
            if not isinstance(value, str):
                raise MalformedBody(f"{self.path(name)}[{i}] is not a string (got {_kind(value)})")
        return list(values)

    def rows(self, name: str) -> list[_Fields]:
        """A list of objects, each read as its own ``_Fields``."""
        values = self._get(name, list, "a list", False)
        return [_Fields(value, f"{self.path(name)}[{i}]") for i, value in enumerate(values)]

    def time(self, name: str, optional: bool = False) -> Any:
        value = self._get(name, str, "an RFC 3339 time", optional)
        if value is None:
            return None
        try:
            at = parse_time(value)
        except ValueError:
            raise MalformedBody(f"{self.path(name)} is not an RFC 3339 time (got {value!r})") from None
        if at.tzinfo is None:  # not a point in time: api.md's times always carry their offset
            raise MalformedBody(f"{self.path(name)} is not an RFC 3339 time (no offset: {value!r})")
        return at.astimezone(UTC)  # the same instant, in UTC as the docstring promises


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
    out, the server uses the time the result first arrived (and keeps it for the retries). A
    ``datetime`` without a time zone is ``InvalidRequest`` (422 ``invalid_time``, naming the field)
    when posted, before anything is sent.
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
    ``duplicate`` (a replay of a result it already has), or one of the router's additions, which
    wrote nothing (``overflow``, ``region_conflict``, and the moderation refusals ``banned``,
    ``points_limit``, ``rate_limit``); ``points`` is the player's ``total`` after the write.

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
    def from_body(cls, body: Any, where: str = "") -> ScoreOutcome:
        f = _Fields(body, where)
        closed = tuple(f.texts("closed_periods", optional=True))
        return cls(f.text("player_id"), f.text("match_id"), f.text("status"), f.integer("points"), closed)


def outcomes_of(body: Any, sent: int) -> list[ScoreOutcome]:
    """The outcomes of a write of ``sent`` scores: one per score, in order, or the answer is not
    one the caller's results can be matched with."""
    rows = _Fields(body).rows("results")
    if len(rows) != sent:
        raise MalformedBody(f"results has {len(rows)} items for {sent} scores")
    return [ScoreOutcome.from_body(row.body, row.where) for row in rows]


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
    def from_body(cls, body: Any, where: str = "") -> Entry:
        f = _Fields(body, where)
        return cls(
            f.integer("rank"),
            f.text("player_id"),
            f.integer("points"),
            f.time("achieved_at"),
            body.get("reward"),
        )


def entries_of(body: Any) -> list[Entry]:
    return [Entry.from_body(row.body, row.where) for row in _Fields(body).rows("entries")]


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
    def from_body(cls, body: Any) -> Page:
        f = _Fields(body)
        return cls(
            f.text("board"),
            f.text("period"),
            entries_of(body),
            f.time("as_of"),
            f.flag("settled"),
            f.text("settlement_id", optional=True),
            f.time("resets_at", optional=True),
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
    def from_body(cls, body: Any) -> PlayerRank:
        f = _Fields(body)
        return cls(
            f.text("player_id"),
            f.integer("rank"),
            f.integer("points"),
            f.time("achieved_at"),
            f.integer("players"),
            f.number("percentile"),
            f.integer("rank_error", optional=True),
            f.time("as_of", optional=True),
            f.time("counts_as_of", optional=True),
            f.flag("settled"),
            f.text("settlement_id", optional=True),
            body.get("reward"),
            f.time("resets_at", optional=True),
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
    def from_body(cls, body: Any, created: bool | None = None, where: str = "") -> BoardInfo:
        f = _Fields(body, where)
        return cls(
            f.text("board"),
            f.text("mode"),
            f.text("order"),
            f.texts("periods"),
            dict(f.mapping("sharding")),
            {k: v for k, v in body.items() if k not in _STATE},
            f.counts("players"),
            created,
            f.times_by_name("resets_at"),
            f.flag("closed", absent=None),  # None, not False, from all but get_board
        )


def boards_of(body: Any) -> list[BoardInfo]:
    return [BoardInfo.from_body(row.body, where=row.where) for row in _Fields(body).rows("boards")]
