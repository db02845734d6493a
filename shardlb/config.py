"""Board settings: one frozen dataclass, built from an API body and checked field by field."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace
from typing import Any

from shardlb import periods, times
from shardlb.codec import ScoreCodec
from shardlb.errors import InvalidInput, field_name

ID_MAX = 64  # characters in a board, player or region id
ID_PATTERN = re.compile(rf"^[A-Za-z0-9_\-.:]{{1,{ID_MAX}}}$", re.ASCII)
# Ids one a line, for ``all_ids``: "\n" is no id's character.
_ID_LINES = re.compile(rf"[A-Za-z0-9_\-.:]{{1,{ID_MAX}}}(?:\n[A-Za-z0-9_\-.:]{{1,{ID_MAX}}})*", re.ASCII)
MATCH_ID_MAX = 128  # characters in a match id (api.md: 1-128)
MODES = ("best", "incr", "set")
DURABILITY = ("journal", "memory")
ORDERS = ("desc", "asc")
TIEBREAKS = ("earliest", "latest")
STRATEGIES = ("hash", "region", "band")
RANK_MODES = ("unique", "competition")  # how reads number players of equal points (reads.py)
TIE_AWARDS = ("cut", "all")  # how a settlement pays ties at a reward boundary (shardlb/settlement_rewards.py)
DEFAULT_EPOCH_MS = 1_577_836_800_000  # 2020-01-01T00:00:00Z
DEFAULT_RETENTION = {"daily": 3, "weekly": 35, "monthly": 400}
MAX_SHARDS = 1024
MAX_BANDS = 256
MAX_POINTS = 2**53 - 1  # the largest points_max: a packed score must stay below 2**53
MAX_RETENTION_DAYS = 36_500
DEDUP_WINDOW_S = (60, 30 * 86_400)  # the shortest and longest dedup window of an incr board
DEFAULT_SHARDS = 16  # a library caller's default (BoardConfig.from_dict); see AUTO_SHARDS
# Hash and band settings that name no shard count, as the HTTP API reads them: the board gets one
# shard per master of the cluster when it is created (BoardStore.create, ``resolve_shards``). A read
# of a hash board costs a round trip and a few commands per shard, so shards beyond the masters add
# that cost and no capacity; more pay only when masters will be added by moving slots instead of by
# resharding the board (README, "Sharding"). 0 is never a stored shard count.
AUTO_SHARDS = 0
DEFAULT_POINTS_MAX = 2_097_151  # with resolution ms, small enough to leave 30 days of time bits
DEFAULT_DEDUP_WINDOW_S = 86_400  # api.md: "within the board's dedup window, default 24 h"
# Boards `shardlb rebuild --all` restores and rebuilds side by side (its --jobs; shardlb/rebuild.py,
# ``Rebuilder.jobs``), each on a PostgreSQL connection of its own. Measured on 2 cores (bench/README.md,
# "Chaos"): more only adds connections once Redis, PostgreSQL and the rebuild share the cores.
REBUILD_JOBS = 4
# An incr board's dedup window is kept in this many time buckets, one set each per shard. A bucket
# expires a window after it ends, so a member lives between one window and one window plus a
# bucket: memory peaks at (1 + 1/DEDUP_BUCKETS) windows of writes. Each bucket costs one more
# SISMEMBER per new result; at 24 (hourly for the default window) the peak is 1.04 windows against
# 1.25 with 4, for ~5.5 us more Redis CPU per incr result (bench/dedup.py). With a 24 h window,
# dedup memory, not CPU, bounds what an incr master takes, by ten times or more (README, "Memory").
DEDUP_BUCKETS = 24
# A result sent without a time pins its first server time in a hash of the window's buckets
# (write.lua); each pin hash spans PIN_SPAN dedup buckets, so a new result is looked up in about
# 24 / PIN_SPAN + 1 hashes instead of 25 (one HMGET each per call: for such results most of Redis's
# time in a call). A pin then lives between one window and one window plus PIN_SPAN buckets: at 4
# the peak is 1.17 windows of such results against 1.04 (docs/design-notes.md, "Retries without
# `achieved_at`"). Pin hashes are named by their first dedup bucket, so those written with another
# span (1, before) are still found through the shard's key index until they expire.
PIN_SPAN = 4
# A dated period takes results until its end plus close_grace seconds, then it is closed: 5 minutes
# by default, up to 7 days (a later close would outlive a short retention for nothing).
DEFAULT_CLOSE_GRACE_S = 300
CLOSE_GRACE_S = (0, 7 * 86_400)
# Optional moderation settings (shardlb/moderation.py; null: off) and their largest values.
MODERATION = ("max_points_per_result", "max_results_per_player_per_minute", "inactive_after")
# Every field of a board's settings, in the order ``BoardConfig.to_dict`` writes them.
SETTINGS = (
    "board", "mode", "order", "tiebreak", "periods", "timezone", "retention_days", "points_max", "epoch",
    "resolution", "dedup_window_s", "durability", "sharding", "rank_mode", "close_grace", "week_start",
    "tie_awards", *MODERATION,
)  # fmt: skip
MODERATION_MAX = {"max_points_per_result": MAX_POINTS, "max_results_per_player_per_minute": 100_000,
                  "inactive_after": 10 * 365 * 86_400}  # fmt: skip


def all_ids(values: list[Any]) -> bool:
    """Whether every value is an id (``ID_PATTERN``), by one match over them all, one a line: a
    match's fixed part (its state, its Match object: some 2,000 instructions) was most of a score's
    check, and a write checks each of its player ids."""
    try:
        lines = "\n".join(values)
    except TypeError:  # a value that is not a string
        return False
    # A value holding a line end would pass as two lines: as many lines as values, or not all ids.
    return not values or (lines.count("\n") == len(values) - 1 and _ID_LINES.fullmatch(lines) is not None)


def check_id(value: object, field_name: str) -> str:
    if not isinstance(value, str) or ID_PATTERN.fullmatch(value) is None:
        raise InvalidInput(f"ids are 1-{ID_MAX} characters of A-Z a-z 0-9 _ - . :", field_name, "invalid_id")
    return value


# Where a band board's shards sit on the slots (shardlb/sharding.py, ``Layout.slot_group``):
# "spread" interleaves the home shards and the bands, so that a cluster of as many masters as bands
# gives each master one band and one home shard; "window", the placement of band boards created
# before there was a choice, puts the home shards in the first slot windows and the bands after them
# (with 3 of each on 3 masters: two home shards on the first, two bands on the last). Stored band
# settings without the field are "window" (``stored_sharding``); new ones are "spread".
BAND_PLACEMENTS = ("spread", "window")


@dataclass(frozen=True)
class Sharding:
    strategy: str = "hash"
    shards: int = DEFAULT_SHARDS
    regions: tuple[str, ...] = ()
    shards_per_region: int = 0
    bands: tuple[int, ...] = ()
    placement: str = ""  # band boards: one of BAND_PLACEMENTS; "" for the others

    def to_dict(self) -> dict[str, Any]:
        if self.strategy == "region":
            return {
                "strategy": "region",
                "regions": list(self.regions),
                "shards_per_region": self.shards_per_region,
            }
        if self.strategy == "band":
            return {
                "strategy": "band",
                "bands": list(self.bands),
                "shards": self.shards,
                "placement": self.placement,
            }
        return {"strategy": "hash", "shards": self.shards}


@dataclass(frozen=True)
class BoardConfig:
    """Everything that defines a board. Two boards are the same board when these are equal."""

    id: str
    mode: str = "best"
    order: str = "desc"
    tiebreak: str = "earliest"
    periods: tuple[str, ...] = ("total",)
    timezone: str = "UTC"
    retention_days: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_RETENTION))
    points_max: int = DEFAULT_POINTS_MAX
    epoch_ms: int = DEFAULT_EPOCH_MS
    resolution: str = "s"
    dedup_window_s: int = DEFAULT_DEDUP_WINDOW_S
    # "journal": every applied result is journaled in the same script call and archived in
    # PostgreSQL (shardlb/archive.py); "memory": Redis only, lost with it (a board that can be lost).
    durability: str = "journal"
    sharding: Sharding = field(default_factory=Sharding)
    rank_mode: str = "unique"  # the reads' default; a read may ask for the other (RANK_MODES)
    close_grace_s: int = DEFAULT_CLOSE_GRACE_S
    week_start: str = "monday"  # the local weekday weekly periods start on (shardlb/periods.py)
    tie_awards: str = "cut"
    # Moderation (shardlb/moderation.py), each off when None: results above these points or past this
    # many per player and minute are refused; players idle this many seconds leave the total board.
    max_points_per_result: int | None = None
    max_results_per_player_per_minute: int | None = None
    inactive_after: int | None = None

    @property
    def dedup_bucket_ms(self) -> int:
        """How long one incr dedup bucket covers (see DEDUP_BUCKETS)."""
        return self.dedup_window_s * 1000 // DEDUP_BUCKETS

    def codec(self) -> ScoreCodec:
        return ScoreCodec(self.points_max, self.order, self.tiebreak, self.resolution, self.epoch_ms)

    def to_dict(self) -> dict[str, Any]:
        return {
            "board": self.id,
            "mode": self.mode,
            "order": self.order,
            "tiebreak": self.tiebreak,
            "periods": list(self.periods),
            "timezone": self.timezone,
            "retention_days": dict(self.retention_days),
            "points_max": self.points_max,
            "epoch": times.format_ms(self.epoch_ms),
            "resolution": self.resolution,
            "dedup_window_s": self.dedup_window_s,
            "durability": self.durability,
            "sharding": self.sharding.to_dict(),
            "rank_mode": self.rank_mode,
            "close_grace": self.close_grace_s,
            "week_start": self.week_start,
            "tie_awards": self.tie_awards,
            **{name: getattr(self, name) for name in MODERATION},
        }

    @classmethod
    def from_dict(
        cls, board_id: str, body: dict[str, Any], default_shards: int = DEFAULT_SHARDS
    ) -> BoardConfig:
        """Build and check a config from an API body (or a stored ``to_dict``). Raises InvalidInput.

        Hash and band settings without ``shards`` take ``default_shards``; the HTTP API passes
        AUTO_SHARDS (one per master, decided by ``BoardStore.create``)."""
        check_id(board_id, "board")
        if not isinstance(body, dict):
            raise InvalidInput("the board settings must be an object", None)
        for name in body:
            if name not in SETTINGS:
                raise InvalidInput(f"unknown setting {field_name(name)!r}", name, "unknown_field")
        mode = _choice(body, "mode", MODES, "best")
        order = _choice(body, "order", ORDERS, "desc")
        tiebreak = _choice(body, "tiebreak", TIEBREAKS, "earliest")
        resolution = _choice(body, "resolution", ("s", "ms"), "s")
        kept = _periods(body.get("periods", ["total"]))
        tz_name = body.get("timezone", "UTC")
        if not isinstance(tz_name, str):
            raise InvalidInput("timezone must be an IANA name", "timezone")
        periods.zone(tz_name)
        retention = dict(DEFAULT_RETENTION)
        given = body.get("retention_days", {})
        if not isinstance(given, dict):
            raise InvalidInput("retention_days must be an object", "retention_days")
        for kind, days in given.items():
            if kind not in periods.DATED:
                named = field_name(kind)
                raise InvalidInput(f"no retention for {named!r}", f"retention_days.{named}")
            retention[kind] = _int(days, f"retention_days.{kind}", 0, MAX_RETENTION_DAYS)
        retention = {kind: days for kind, days in retention.items() if kind in kept}
        points_max = _int(body.get("points_max", DEFAULT_POINTS_MAX), "points_max", 1, MAX_POINTS)
        epoch_ms = times.parse(body["epoch"], "epoch") if body.get("epoch") is not None else DEFAULT_EPOCH_MS
        dedup = _int(body.get("dedup_window_s", DEFAULT_DEDUP_WINDOW_S), "dedup_window_s", *DEDUP_WINDOW_S)
        config = cls(
            id=board_id,
            mode=mode,
            order=order,
            tiebreak=tiebreak,
            periods=kept,
            timezone=tz_name,
            retention_days=retention,
            points_max=points_max,
            epoch_ms=epoch_ms,
            resolution=resolution,
            dedup_window_s=dedup,
            durability=_choice(body, "durability", DURABILITY, "journal"),
            sharding=_sharding(body.get("sharding", {"strategy": "hash"}), default_shards),
            rank_mode=_choice(body, "rank_mode", RANK_MODES, "unique"),
            close_grace_s=_int(body.get("close_grace", DEFAULT_CLOSE_GRACE_S), "close_grace", *CLOSE_GRACE_S),
            week_start=_choice(body, "week_start", periods.WEEKDAYS, "monday"),
            tie_awards=_choice(body, "tie_awards", TIE_AWARDS, "cut"),
            **{
                n: None if body.get(n) is None else _int(body[n], n, 1, MODERATION_MAX[n]) for n in MODERATION
            },
        )
        config.codec()
        if config.sharding.bands and config.sharding.bands[-1] > points_max:
            raise InvalidInput("every band must start at or below points_max", "sharding.bands")
        return config


def _choice(body: dict[str, Any], name: str, allowed: tuple[str, ...], default: str) -> str:
    value = body.get(name, default)
    if value not in allowed:
        raise InvalidInput(f"{name} must be one of {', '.join(allowed)}", name)
    return str(value)


def _int(value: object, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidInput(f"{name} must be an integer from {lo} to {hi}", name)
    return value


def _periods(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidInput("periods must be a list of period names", "periods")
    for kind in value:
        if kind not in periods.KINDS:
            raise InvalidInput(f"unknown period {kind!r}; use {', '.join(periods.KINDS)}", "periods")
    return tuple(kind for kind in periods.KINDS if kind == "total" or kind in value)


def _sharding(value: object, default_shards: int = DEFAULT_SHARDS) -> Sharding:
    if not isinstance(value, dict):
        raise InvalidInput("sharding must be an object", "sharding")
    strategy = value.get("strategy", "hash")
    if strategy not in STRATEGIES:
        raise InvalidInput(f"sharding.strategy must be one of {', '.join(STRATEGIES)}", "sharding.strategy")
    allowed = {
        "hash": ("strategy", "shards"),
        "region": ("strategy", "regions", "shards_per_region"),
        "band": ("strategy", "bands", "shards", "placement"),
    }[strategy]
    for name in value:
        if name not in allowed:
            raise _not_a_setting(name, value, strategy, allowed)
    if strategy == "hash":
        if "shards" not in value:
            return Sharding("hash", default_shards)
        return Sharding("hash", _int(value["shards"], "sharding.shards", 1, MAX_SHARDS))
    if strategy == "region":
        regions = value.get("regions")
        if not isinstance(regions, list) or not regions or len(set(map(str, regions))) != len(regions):
            raise InvalidInput(
                "sharding.regions must be a non-empty list of distinct ids", "sharding.regions"
            )
        for i, region in enumerate(regions):
            check_id(region, f"sharding.regions[{i}]")
        per = _int(value.get("shards_per_region", 4), "sharding.shards_per_region", 1, MAX_SHARDS)
        if per * len(regions) > MAX_SHARDS:
            raise InvalidInput(f"at most {MAX_SHARDS} shards in all", "sharding.shards_per_region")
        return Sharding("region", per * len(regions), tuple(regions), per)
    bands = value.get("bands")
    if bands is None:
        raise InvalidInput(
            "band sharding needs sharding.bands, the points at which each band starts: increasing "
            "integers from 0, e.g. [0, 1000, 10000]; each band gets a shard of its own, beside the "
            "home shards that sharding.shards counts",
            "sharding.bands",
        )
    if isinstance(bands, list) and len(bands) > MAX_BANDS:
        raise InvalidInput(f"sharding.bands: at most {MAX_BANDS} bands", "sharding.bands")
    if (
        not isinstance(bands, list)
        or not bands
        or not all(isinstance(b, int) and not isinstance(b, bool) for b in bands)
        or bands[0] != 0
        or any(a >= b for a, b in itertools.pairwise(bands))
    ):
        raise InvalidInput(
            "sharding.bands must be increasing integers starting at 0, e.g. [0, 1000, 10000]",
            "sharding.bands",
        )
    shards = default_shards
    if "shards" in value:
        try:
            shards = _int(value["shards"], "sharding.shards", 1, MAX_SHARDS - len(bands))
        except InvalidInput as e:
            raise InvalidInput(
                f"{e.message}: a band board's home shards and its {len(bands)} band shards are at "
                f"most {MAX_SHARDS} in all",
                e.field,
            ) from e
    placement = value.get("placement", BAND_PLACEMENTS[0])
    if placement not in BAND_PLACEMENTS:
        raise InvalidInput(
            f"sharding.placement must be one of {', '.join(BAND_PLACEMENTS)}", "sharding.placement"
        )
    return Sharding("band", shards, (), 0, tuple(bands), placement)


def _not_a_setting(
    name: object, value: dict[Any, Any], strategy: str, allowed: tuple[str, ...]
) -> InvalidInput:
    """The error of a sharding key ``name`` that ``strategy`` does not take. With no "strategy" in
    ``value`` the client may not know hash was taken for it: the message says so, and how to name
    another (a key whose value is a strategy's name was most likely meant as "strategy")."""
    named = field_name(name)
    message = f"{named!r} is not a setting of {strategy} sharding, which takes {', '.join(allowed)}"
    if "strategy" not in value:
        message += f' (hash, as no "strategy" is named; the strategies are {", ".join(STRATEGIES)})'
        meant = value[name]
        if isinstance(meant, str) and meant in STRATEGIES:
            message += f': did you mean "strategy": "{meant}"?'
    return InvalidInput(message, f"sharding.{named}")


def resolve_shards(config: BoardConfig, masters: int, existing: BoardConfig | None = None) -> BoardConfig:
    """``config`` with AUTO_SHARDS made a shard count: an existing board's own when there is one
    (settings that name no shard count confirm a board of any), else one per master (``masters``;
    at least 1, and within MAX_SHARDS beside a band board's bands). Any other config is returned as
    it is."""
    sharding = config.sharding
    if sharding.shards != AUTO_SHARDS or sharding.strategy not in ("hash", "band"):
        return config
    if existing is not None and existing.sharding.strategy == sharding.strategy:
        shards = existing.sharding.shards
    else:
        shards = max(1, min(masters, MAX_SHARDS - len(sharding.bands)))
    return replace(config, sharding=replace(sharding, shards=shards))


def stored_sharding(value: Any) -> Any:
    """Sharding settings as a registry record, a reshard's record or the archive keeps them: band
    settings written before there was a placement get the one they were laid out with ("window")."""
    if isinstance(value, dict) and value.get("strategy") == "band" and "placement" not in value:
        return {**value, "placement": "window"}
    return value


def stored_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """A stored board's settings, with ``stored_sharding`` applied to its sharding."""
    if "sharding" not in settings:
        return settings
    return {**settings, "sharding": stored_sharding(settings["sharding"])}
