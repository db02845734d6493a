"""RetryRecords (shardlb/rebuild.py) without a server: which retry records a rebuild puts back, under
which names and expiries (write.lua's), for which results."""

from __future__ import annotations

import msgpack

from shardlb.board import Board
from shardlb.config import PIN_SPAN, BoardConfig
from shardlb.rebuild import PIN_SLACK_MS, RetryRecords

PREFIX = "lb:{x}:b:1:0:"
HOUR = 3_600_000


def records(mode: str, now: int) -> RetryRecords:
    config = BoardConfig.from_dict("b", {"mode": mode, "epoch": "2026-01-01T00:00:00Z"})
    return RetryRecords(Board(None, config, None, "1"), PREFIX, now)  # type: ignore[arg-type]


def batch(r: RetryRecords) -> list[tuple[str, int, int, str, int]]:
    """(key, is a pin hash, expiry, member, units) per record, from what ``take`` sends."""
    names, header, items = r.take()
    _, pin, expiry = msgpack.unpackb(header)
    flat = msgpack.unpackb(items)
    out = []
    for i in range(0, len(flat), 3):
        n = flat[i] - 1
        out.append((names[n], pin[n], expiry[n], flat[i + 1], flat[i + 2]))
    return out


def test_an_incr_result_goes_into_its_arrival_bucket_while_write_lua_looks_there() -> None:
    now = 1_800_000_000_000
    r = records("incr", now)
    first = (now - 24 * HOUR) // HOUR  # the default window of 24 buckets of an hour
    assert r.since_ms == first * HOUR
    r.add(first * HOUR - 1, "gone", "p1", 0)  # its bucket is no longer looked up: left out
    r.add(first * HOUR, "m1", "p1", 0)
    r.add(now, "m\x002", "p2", 0)  # a match id may hold anything but NUL; the player id follows the last
    assert batch(r) == [
        (f"{PREFIX}dd:{first}", 0, (first + 1) * HOUR + 24 * HOUR, "m1\x00p1", 0),
        (f"{PREFIX}dd:{now // HOUR}", 0, (now // HOUR + 1) * HOUR + 24 * HOUR, "m\x002\x00p2", 0),
    ]
    assert len(r) == 0  # taken


def test_a_best_result_achieved_at_its_arrival_gets_its_pin_back() -> None:
    now = 1_800_000_000_000
    r = records("best", now)
    units = (now - 5 * HOUR - r.codec.epoch_ms) // 1000
    at = r.codec.units_to_ms(units)
    r.add(at + 400, "m1", "p1", units)  # sent without a time: its arrival, rounded down to the second
    r.add(at + 1000 + PIN_SLACK_MS + 1, "m2", "p1", units)  # sent with a time well before it arrived
    k = at // HOUR
    start = k - k % PIN_SPAN
    expiry = (start + PIN_SPAN) * HOUR + 24 * HOUR
    assert batch(r) == [(f"{PREFIX}pin:{start}", 1, expiry, "m1\x00p1", units)]


def test_pins_of_hashes_write_lua_no_longer_reads_are_left_out() -> None:
    now = 1_800_000_000_000
    r = records("set", now)
    first = (now - 24 * HOUR) // HOUR
    oldest = (first - first % PIN_SPAN) * HOUR  # the first hash write.lua still reads
    for at in (oldest - 1, oldest):
        units = (at - r.codec.epoch_ms) // 1000
        r.add(r.codec.units_to_ms(units), f"m{at}", "p1", units)
    assert [key for key, *_ in batch(r)] == [f"{PREFIX}pin:{oldest // HOUR}"]


def test_removals_of_the_window_come_back_in_every_mode() -> None:
    """remove.lua's record of a removal (player -> its time units), for the dedup window: a removal
    older than the window is left out; the hash expires a window after the latest removal."""
    now = 1_800_000_000_000
    for mode in ("incr", "best", "set"):
        r = records(mode, now)
        assert r.since_ms <= now - 24 * HOUR
        units = [(t - r.codec.epoch_ms) // 1000 for t in (now - 5 * HOUR, now - HOUR)]
        r.removed(now - 24 * HOUR - 1, "old", 1)  # out of the window: write.lua would have dropped it
        r.removed(now - 5 * HOUR, "p1", units[0])
        r.removed(now - HOUR, "p2", units[1])
        expiry = now - HOUR + 24 * HOUR
        assert batch(r) == [
            (f"{PREFIX}rmv", 2, expiry, "p1", units[0]),
            (f"{PREFIX}rmv", 2, expiry, "p2", units[1]),
        ]


def test_a_pin_comes_back_for_a_router_whose_clock_is_30_s_off_redis() -> None:
    """A result's arrival is its journal id's time, Redis's clock; its server time was the writing
    router's. With a slack of 10 s, the results of a router 30 s ahead of Redis or 30 s behind got
    no pin back after a loss of Redis, and a retry of one of them sent without a time then took its
    own arrival as its time (across midnight, a second day's board). The slack covers a minute."""
    now = 1_800_000_000_000
    r = records("best", now)
    units = (now - 5 * HOUR - r.codec.epoch_ms) // 1000
    at = r.codec.units_to_ms(units)
    r.add(at - 30_000, "ahead", "p1", units)  # the router's clock 30 s ahead of Redis's
    r.add(at + 30_000, "behind", "p2", units)  # and 30 s behind
    k = at // HOUR
    start = k - k % PIN_SPAN
    expiry = (start + PIN_SPAN) * HOUR + 24 * HOUR
    assert batch(r) == [
        (f"{PREFIX}pin:{start}", 1, expiry, "ahead\x00p1", units),
        (f"{PREFIX}pin:{start}", 1, expiry, "behind\x00p2", units),
    ]
