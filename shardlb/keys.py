"""Every Redis key name shardlb uses, and the placement of shards on hash slots.

All keys of one shard share one hash tag, so one Lua call can touch every period of the shard, its
dedup buckets and its key index atomically:

    lb:{<board>:<shard>:<salt>}:total          sorted set, the all-time board
    lb:{...}:d:2026-11-30 / w:2026-W48 / m:2026-11   dated period boards
    lb:{...}:dd:<bucket>                      incr dedup set for one time bucket
    lb:{...}:idx                              sorted set of this shard's keys, scored by expiry
    lb:{...}:ver                              band boards: per-player version of the total

``salt`` is the smallest number that puts shard i of N near the middle of the i-th N-th of the 16384
slots, so shards spread over the masters by construction instead of by CRC16 chance.
"""

from __future__ import annotations

from functools import lru_cache

from redis.crc import key_slot

SLOTS = 16384
BOARDS = "lb:boards"


def slot_of(key: str) -> int:
    return int(key_slot(key.encode()))


def slot_window(shard: int, shards: int) -> tuple[int, int]:
    """The slots (inclusive) a shard's tag may land on: the middle half of its N-th, at least one slot."""
    start, end = shard * SLOTS // shards, (shard + 1) * SLOTS // shards
    width = end - start
    center = start + width // 2
    half = max(width // 8, 0)
    return center - half, center + half


@lru_cache(maxsize=65536)
def shard_tag(board: str, shard: int, shards: int) -> str:
    """The hash tag (without braces) of shard ``shard`` of ``shards`` of ``board``."""
    if not 0 <= shard < shards <= SLOTS:
        raise ValueError(f"shard {shard} of {shards} is out of range")
    lo, hi = slot_window(shard, shards)
    salt = 0
    while True:
        tag = f"{board}:{shard}:{salt:x}"
        if lo <= slot_of("{" + tag + "}") <= hi:
            return tag
        salt += 1


def shard_prefix(board: str, shard: int, shards: int) -> str:
    return "lb:{" + shard_tag(board, shard, shards) + "}:"


def period_key(prefix: str, period: str) -> str:
    """``period`` is ``total`` or a dated name such as ``d:2026-11-30``."""
    return prefix + period


def dedup_key(prefix: str, bucket: int) -> str:
    return f"{prefix}dd:{bucket}"


def index_key(prefix: str) -> str:
    return prefix + "idx"


def version_key(prefix: str) -> str:
    return prefix + "ver"
