"""The score codec: points and achieved time packed into one integer below 2**53.

A Redis sorted-set score is a double, which holds every integer below 2**53 exactly. Packing
``points`` into the high bits and a time rank into the low bits makes the sorted set's own order the
board's order, tie-break included, with no second lookup. The packing is arranged so that a *better*
result always has a *larger* score, whatever the board's order and tie-break: every read can then use
the descending commands (ZREVRANGE, ZCOUNT of ``(score, +inf``) the same way.

    score = points_part * 2**time_bits + time_part
    points_part = points              (order desc)  |  points_max - points   (order asc)
    time_part   = time_max - t        (earliest)    |  t                     (latest)

where ``t`` is the achieved time in resolution units since the board's epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlb.errors import OutOfRange

SCORE_BITS = 53
RESOLUTION_MS = {"s": 1000, "ms": 1}
MIN_TIME_SPAN_MS = 30 * 86_400_000


@dataclass(frozen=True)
class ScoreCodec:
    """Encode and decode scores for one board's settings. Raises OutOfRange, never wraps or rounds."""

    points_max: int = 2_097_151
    order: str = "desc"
    tiebreak: str = "earliest"
    resolution: str = "s"
    epoch_ms: int = 0
    # Derived once: the write path encodes every score, and these sit on its hot loop.
    points_bits: int = field(init=False, repr=False, compare=False)
    time_bits: int = field(init=False, repr=False, compare=False)
    time_max: int = field(init=False, repr=False, compare=False)
    unit_ms: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.order not in ("desc", "asc"):
            raise OutOfRange(f"order must be 'desc' or 'asc', not {self.order!r}", "order")
        if self.tiebreak not in ("earliest", "latest"):
            raise OutOfRange(f"tiebreak must be 'earliest' or 'latest', not {self.tiebreak!r}", "tiebreak")
        if self.resolution not in RESOLUTION_MS:
            raise OutOfRange(f"resolution must be 's' or 'ms', not {self.resolution!r}", "resolution")
        if not 1 <= self.points_max < 2**SCORE_BITS:
            raise OutOfRange("points_max must be between 1 and 2**53 - 1", "points_max")
        derive = object.__setattr__
        derive(self, "points_bits", self.points_max.bit_length())
        derive(self, "time_bits", SCORE_BITS - self.points_bits)
        derive(self, "time_max", (1 << self.time_bits) - 1)
        derive(self, "unit_ms", RESOLUTION_MS[self.resolution])
        if self.time_max * self.unit_ms < MIN_TIME_SPAN_MS:
            bits = self.points_bits
            while ((1 << (SCORE_BITS - bits)) - 1) * self.unit_ms < MIN_TIME_SPAN_MS:
                bits -= 1
            coarser = " (or use resolution 's')" if self.resolution == "ms" else ""
            raise OutOfRange(
                f"points_max {self.points_max} leaves {self.time_bits} bits of time, under 30 days at "
                f"resolution {self.resolution!r}: it can be at most {(1 << bits) - 1}{coarser}",
                "points_max",
            )

    @property
    def last_ms(self) -> int:
        """The last epoch millisecond the codec can represent."""
        return self.epoch_ms + self.time_max * self.unit_ms + self.unit_ms - 1

    def check_points(self, points: int, field: str = "points") -> int:
        if isinstance(points, bool) or not isinstance(points, int):
            raise OutOfRange("points must be an integer", field)
        if not 0 <= points <= self.points_max:
            raise OutOfRange(f"points must be between 0 and {self.points_max}, got {points}", field)
        return points

    def time_units(self, achieved_ms: int, field: str = "achieved_at") -> int:
        """Achieved time (epoch ms) as resolution units since the board's epoch."""
        if achieved_ms < self.epoch_ms:
            raise OutOfRange("achieved_at is before the board's epoch", field)
        units = (achieved_ms - self.epoch_ms) // self.unit_ms
        if units > self.time_max:
            raise OutOfRange("achieved_at is past the last time this board's codec can hold", field)
        return units

    def units_to_ms(self, units: int) -> int:
        return self.epoch_ms + units * self.unit_ms

    def encode_units(self, points: int, units: int) -> int:
        points_part = points if self.order == "desc" else self.points_max - points
        time_part = self.time_max - units if self.tiebreak == "earliest" else units
        return (points_part << self.time_bits) | time_part

    def encode(self, points: int, achieved_ms: int) -> int:
        """Pack points and an achieved time (epoch ms) into one exact score."""
        return self.encode_units(self.check_points(points), self.time_units(achieved_ms))

    def scores_of(self, points: int) -> range:
        """Every score that carries ``points``, whatever its achieved time: one contiguous range, as the
        points sit in the high bits. Every score from the range's ``stop`` up has strictly better points
        (so ZCOUNT from ``stop`` counts the players ahead on points alone: competition ranks)."""
        part = points if self.order == "desc" else self.points_max - points
        return range(part << self.time_bits, (part + 1) << self.time_bits)

    def decode_units(self, score: float | int) -> tuple[int, int]:
        value = int(score)
        if value != score or not 0 <= value < 1 << SCORE_BITS:
            raise OutOfRange(f"{score!r} is not a score this codec produced", "score")
        points_part, time_part = value >> self.time_bits, value & self.time_max
        points = points_part if self.order == "desc" else self.points_max - points_part
        units = self.time_max - time_part if self.tiebreak == "earliest" else time_part
        return points, units

    def decode(self, score: float | int) -> tuple[int, int]:
        """Unpack a score into (points, achieved time in epoch ms, rounded down to the resolution)."""
        points, units = self.decode_units(score)
        return points, self.units_to_ms(units)
