"""Reward tables: which final ranks of a settled period earn which reward (pure, no I/O).

A reward table is a JSON list of tiers, read in order; a player gets the reward of the FIRST tier
that covers their rank, so tiers may overlap and an earlier one wins::

    [{"rank": 1, "reward": "gold"},
     {"ranks": [2, 10], "reward": "silver"},
     {"top_percent": 1, "reward": "bronze"}]

Each tier names its ranks one way: ``rank`` (one rank), ``ranks`` ([first, last], inclusive) or
``top_percent`` (0 < p <= 100: ranks 1 to floor(p * players / 100), none when that is 0, so a
table never pays more players than the percentage says). Ranks follow the codec's unique order.

Ties follow the board's ``tie_awards``: ``cut`` (the default) pays by the unique rank, so the
board's own tiebreak (earliest or latest) decides who is in at a tier's last rank and the table pays
exactly the ranks it names; ``all`` pays by competition rank (1 + the players with more points):
every player tied at a boundary gets the tier's reward, and the next distinct points take the rank
after all of them (1, 1, 3), as a competition ranking does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple

from shardlb.config import ID_PATTERN
from shardlb.errors import InvalidInput, field_name

MAX_TIERS = 100
MAX_RANK = 10**9
TIE_RULES = ("cut", "all")


@dataclass(frozen=True)
class Tier:
    reward: str
    first: int = 1
    last: int = 0  # 0 with a percentage: resolved against the number of players
    percent: Fraction | None = None

    def ranks(self, players: int) -> tuple[int, int]:
        """The tier's ranks (first, last) on a board of ``players``; last < first when it pays none."""
        if self.percent is None:
            return self.first, min(self.last, players)
        return 1, int(self.percent * players // 100)

    def to_json(self) -> dict[str, Any]:
        if self.percent is not None:
            value = self.percent
            return {
                "top_percent": int(value) if value.denominator == 1 else float(value),
                "reward": self.reward,
            }
        if self.first == self.last:
            return {"rank": self.first, "reward": self.reward}
        return {"ranks": [self.first, self.last], "reward": self.reward}


def parse(value: object) -> tuple[Tier, ...]:
    """A reward table from its JSON; InvalidInput (field ``rewards[i]...``) when malformed."""
    if not isinstance(value, list) or not value:
        raise InvalidInput("rewards must be a non-empty list of tiers", "rewards", "invalid_rewards")
    if len(value) > MAX_TIERS:
        raise InvalidInput(f"at most {MAX_TIERS} reward tiers", "rewards", "invalid_rewards")
    return tuple(_tier(item, f"rewards[{i}]") for i, item in enumerate(value))


def _tier(item: object, where: str) -> Tier:
    def bad(message: str, field: str = where) -> InvalidInput:
        return InvalidInput(message, field, "invalid_rewards")

    if not isinstance(item, dict):
        raise bad('a tier is an object such as {"ranks": [2, 10], "reward": "silver"}')
    named = [k for k in ("rank", "ranks", "top_percent") if k in item]
    unknown = [k for k in item if k not in ("rank", "ranks", "top_percent", "reward")]
    if unknown:
        name = field_name(unknown[0])
        raise bad(f"unknown field {name!r}", f"{where}.{name}")
    if len(named) != 1:
        raise bad("a tier gives exactly one of rank, ranks, top_percent")
    reward = item.get("reward")
    if not isinstance(reward, str) or ID_PATTERN.fullmatch(reward) is None:
        raise bad("reward must be an id: 1-64 characters of A-Z a-z 0-9 _ - . :", f"{where}.reward")
    kind = named[0]
    value = item[kind]
    if kind == "rank":
        rank = _rank(value, f"{where}.rank")
        return Tier(reward, rank, rank)
    if kind == "ranks":
        if not isinstance(value, list) or len(value) != 2:
            raise bad("ranks is [first, last], e.g. [2, 10]", f"{where}.ranks")
        first, last = (_rank(v, f"{where}.ranks") for v in value)
        if last < first:
            raise bad("ranks [first, last] needs first <= last", f"{where}.ranks")
        return Tier(reward, first, last)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 100:
        raise bad("top_percent must be a number above 0 and at most 100", f"{where}.top_percent")
    return Tier(reward, percent=Fraction(str(value)))


def _rank(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANK:
        raise InvalidInput(f"a rank is an integer from 1 to {MAX_RANK}", field, "invalid_rewards")
    return value


def to_json(tiers: Sequence[Tier]) -> list[dict[str, Any]]:
    """The table in its one canonical spelling (what a settlement stores and compares)."""
    return [t.to_json() for t in tiers]


class Award(NamedTuple):
    rank: int  # the unique rank (the codec's order), also under the "all" rule
    reward: str


def deepest(tiers: Sequence[Tier], players: int) -> int:
    """The last rank any tier names on a board of ``players``."""
    return max((t.ranks(players)[1] for t in tiers), default=0)


def assign(
    tiers: Sequence[Tier], points: Sequence[int], rule: str, players: int | None = None
) -> list[Award]:
    """The awards of a board of ``players`` (default ``len(points)``) whose players, in final order,
    have ``points`` (rank i + 1 at index i; a prefix is enough when it reaches ``deepest`` and every
    following player with the points of that rank): one per rewarded player, by the first tier
    covering their rank. Under ``cut`` that rank is the unique one; under ``all`` it is the
    competition rank (1 + the players with more points), so equal points earn equal rewards."""
    if rule not in TIE_RULES:
        raise InvalidInput(f"tie_awards must be one of {', '.join(TIE_RULES)}", "tie_awards")
    players = len(points) if players is None else players
    spans = [t.ranks(players) for t in tiers]
    last_paid = max((last for _, last in spans), default=0)
    out: list[Award] = []
    counted = 1
    for i in range(len(points)):
        if rule == "all" and i and points[i] != points[i - 1]:
            counted = i + 1
        rank = counted if rule == "all" else i + 1
        if rank > last_paid:
            break
        reward = next((t.reward for t, (a, b) in zip(tiers, spans, strict=True) if a <= rank <= b), None)
        if reward is not None:
            out.append(Award(i + 1, reward))
    return out
