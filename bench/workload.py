"""The simulated game: who plays, what they score, and what players read. Pure, no I/O.

One Workload drives every contender the same way (Locust over HTTP, the library straight at the
cluster, the textbook sorted set, PostgreSQL), so their figures compare like for like.

- Player ids are ``p<index>`` with index in [0, players). Activity is skewed like a Zipf law:
  ``index = floor(players * u ** skew)`` for uniform u, so with skew 2 the most active 10% of the
  population play about 32% of the matches and the top 1% about 10%. skew 1 is uniform.
- Points come from ``SHARDLB_POINTS``: ``lognormal:MU,SIGMA`` (default ``lognormal:9,1``: a median
  of about 8100 and a long tail), ``uniform:LO,HI`` or ``normal:MU,SIGMA``; clipped to [0, points_max].
- The population's starting points use the same distribution, seeded by index, so every store
  preloads exactly the same players with the same points.
"""

from __future__ import annotations

import math
import os
import random
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import NormalDist

POINTS_MAX = 2_097_151
INITIAL_SPREAD_S = 30 * 86_400
_MASK = 2**64 - 1
_NORMAL = NormalDist()
READ_KINDS = ("top", "rank", "around", "friends", "page")
DEFAULT_READ_MIX = {"top": 30, "rank": 35, "around": 15, "friends": 15, "page": 5}


@dataclass(frozen=True)
class Points:
    """A points distribution: ``kind`` is lognormal, uniform or normal with parameters a, b."""

    kind: str = "lognormal"
    a: float = 9.0
    b: float = 1.0

    @classmethod
    def parse(cls, text: str) -> Points:
        kind, _, params = text.partition(":")
        try:
            a, b = (float(x) for x in params.split(","))
        except ValueError as e:
            raise ValueError(f"SHARDLB_POINTS: expected KIND:A,B, got {text!r}") from e
        if kind not in ("lognormal", "uniform", "normal"):
            raise ValueError(f"SHARDLB_POINTS: kind must be lognormal, uniform or normal, got {kind!r}")
        return cls(kind, a, b)

    def draw(self, rng: random.Random) -> int:
        """A random draw: the same distribution as ``at`` of a uniform, from the C-backed generators
        (a load generator draws ten of these per match; the inverse CDF is pure Python)."""
        if self.kind == "uniform":
            value = rng.uniform(self.a, self.b)
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            value = math.exp(min(rng.gauss(self.a, self.b), 700.0))
        return min(POINTS_MAX, max(0, int(value)))

    def at(self, u: float) -> int:
        """The points at quantile ``u`` (0 < u < 1): inverse-CDF sampling, so a hash can drive it."""
        if self.kind == "uniform":
            value = self.a + u * (self.b - self.a)
        else:
            z = _NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))
            value = self.a + self.b * z
            if self.kind == "lognormal":
                value = math.exp(min(value, 700.0))
        return min(POINTS_MAX, max(0, int(value)))


@dataclass(frozen=True)
class Workload:
    """Every knob of the simulated load, read from ``SHARDLB_*`` variables by ``from_env``."""

    board: str = "bench"
    players: int = 1_000_000
    players_per_match: int = 10
    skew: float = 2.0
    points: Points = field(default_factory=Points)
    retry_share: float = 0.05
    read_mix: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_READ_MIX))
    friends_min: int = 20
    friends_max: int = 200
    page_limit: int = 50
    around_radius: int = 5

    @property
    def fresh_share(self) -> float:
        """The share of the posts that carry new results (the rest replay one, ``retry_share``); 1
        when every post would be a replay, which leaves no fresh rate to target: posts count then."""
        return 1.0 - self.retry_share or 1.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Workload:
        """Build from the environment; a bad value raises ValueError naming the variable."""
        env = os.environ if env is None else env

        def num(name: str, default: float, lo: float, hi: float) -> float:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                value = float(raw)
            except ValueError as e:
                raise ValueError(f"{name}: not a number: {raw!r}") from e
            if not lo <= value <= hi:
                raise ValueError(f"{name}: {raw} is outside [{lo}, {hi}]")
            return value

        friends = env.get("SHARDLB_FRIENDS", "20-200")
        lo, _, hi = friends.partition("-")
        if not (lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi) <= 1000):
            raise ValueError(f"SHARDLB_FRIENDS: expected MIN-MAX within 1-1000, got {friends!r}")
        return cls(
            board=env.get("SHARDLB_BOARD", "bench"),
            players=int(num("SHARDLB_PLAYERS", 1_000_000, 1, 1e10)),
            players_per_match=int(num("SHARDLB_MATCH_PLAYERS", 10, 1, 1000)),
            skew=num("SHARDLB_SKEW", 2.0, 1.0, 20.0),
            points=Points.parse(env.get("SHARDLB_POINTS", "lognormal:9,1")),
            retry_share=num("SHARDLB_RETRY_SHARE", 0.05, 0.0, 1.0),
            read_mix=parse_mix(env.get("SHARDLB_READ_MIX", "")),
            friends_min=int(lo),
            friends_max=int(hi),
            page_limit=int(num("SHARDLB_PAGE_LIMIT", 50, 1, 1000)),
            around_radius=int(num("SHARDLB_AROUND_RADIUS", 5, 0, 100)),
        )

    def player(self, rng: random.Random) -> str:
        """A player id, drawn with the Zipf-like skew (low indices are the most active)."""
        return f"p{int(self.players * rng.random() ** self.skew)}"

    def initial_points(self, index: int) -> int:
        """The points player ``index`` starts with; the same in every store and every process."""
        return self.points.at(unit_hash(index, 1))

    def initial_age_s(self, index: int) -> int:
        """How many seconds before the load player ``index`` reached their points (0 to 30 days).

        Spreading the times keeps exact ties (same points in the same second) as rare as in a live
        board; loading everyone at one instant would make every equal-points pair a tie.
        """
        return int(unit_hash(index, 2) * INITIAL_SPREAD_S)

    def match(self, rng: random.Random) -> tuple[str, list[tuple[str, int]]]:
        """One match: a unique match id and (player, points) for its distinct players."""
        seen: dict[str, int] = {}
        while len(seen) < min(self.players_per_match, self.players):
            seen.setdefault(self.player(rng), self.points.draw(rng))
        return uuid.UUID(int=rng.getrandbits(128), version=4).hex, list(seen.items())

    def friends(self, rng: random.Random) -> list[str]:
        """A friends list: 20-200 (SHARDLB_FRIENDS) distinct ids drawn uniformly from the population."""
        want = min(rng.randint(self.friends_min, self.friends_max), self.players)
        return [f"p{i}" for i in rng.sample(range(self.players), want)]

    def page_offset(self, rng: random.Random) -> int:
        """A page start anywhere in the board, shallow pages more often (players browse from the top)."""
        return int(max(0, self.players - self.page_limit) * rng.random() ** 3)

    def read_kind(self, rng: random.Random) -> str:
        kinds = list(self.read_mix)
        return rng.choices(kinds, weights=[self.read_mix[k] for k in kinds])[0]


def parse_mix(text: str) -> dict[str, int]:
    """``top:30,rank:35,...`` as weights; empty means the default mix."""
    if not text.strip():
        return dict(DEFAULT_READ_MIX)
    mix: dict[str, int] = {}
    for part in text.split(","):
        kind, _, weight = part.strip().partition(":")
        if kind not in READ_KINDS or not weight.isdigit():
            raise ValueError(
                f"SHARDLB_READ_MIX: expected KIND:WEIGHT with KIND in {READ_KINDS}, got {part!r}"
            )
        mix[kind] = int(weight)
    if not any(mix.values()):
        raise ValueError("SHARDLB_READ_MIX: every weight is 0")
    return mix


def top_share(skew: float, share: float) -> float:
    """The share of draws that land in the lowest ``share`` of indices (documentation and tests)."""
    return share ** (1 / skew)


def unit_hash(index: int, salt: int) -> float:
    """A uniform value in (0, 1) from an integer, the same everywhere (a splitmix64 finaliser)."""
    x = (index * 0x9E3779B97F4A7C15 + salt * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    return (x + 0.5) / 2**64
