"""router/refresh.py without a server: one fetch per key at a time, and the kept values' refresh,
idle drop, failure drop and bound."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from router.refresh import Refreshed, SingleFlight
from tests.test_router_logs import kept as kept_lines

WAIT_S = 10.0  # how long a background effect may take on a loaded machine before the test fails


class Source:
    """A fetch that counts its calls and, while ``gate`` is clear, waits for it to be set."""

    def __init__(self) -> None:
        self.calls = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: BaseException | None = None

    def fetch(self, value: str) -> Callable[[], Awaitable[str]]:
        async def run() -> str:
            self.calls += 1
            await self.gate.wait()
            if self.fail is not None:
                raise self.fail
            return value

        return run


async def until(condition: Callable[[], bool]) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never came true"
        await asyncio.sleep(0.005)


async def test_callers_during_a_fetch_share_it_and_later_callers_fetch_again() -> None:
    flights: SingleFlight[str, str] = SingleFlight()
    source = Source()
    source.gate.clear()
    waiters = [asyncio.ensure_future(flights.join("k", source.fetch(f"v{i}"))) for i in range(5)]
    await until(lambda: source.calls == 1)
    assert "k" in flights and "other" not in flights
    other = asyncio.ensure_future(flights.join("other", source.fetch("o")))  # another key: its own fetch
    source.gate.set()
    assert await asyncio.gather(*waiters) == ["v0"] * 5
    assert await other == "o" and source.calls == 2
    assert "k" not in flights
    assert await flights.join("k", source.fetch("again")) == "again" and source.calls == 3


async def test_a_failure_reaches_every_waiter_and_a_waiter_giving_up_cancels_nothing() -> None:
    flights: SingleFlight[str, str] = SingleFlight()
    source = Source()
    source.gate.clear()
    source.fail = RuntimeError("no answer")
    waiters = [asyncio.ensure_future(flights.join("k", source.fetch("v"))) for _ in range(3)]
    await until(lambda: source.calls == 1)
    waiters[0].cancel()
    source.gate.set()
    outcomes = await asyncio.gather(*waiters, return_exceptions=True)
    assert isinstance(outcomes[0], asyncio.CancelledError)
    assert [str(o) for o in outcomes[1:]] == ["no answer", "no answer"]
    source.fail = None
    assert await flights.join("k", source.fetch("v")) == "v" and source.calls == 2


def refreshed(source: Source, **overrides: float) -> Refreshed[str, str]:
    settings: dict[str, float] = {"refresh_s": 0.01, "idle_s": 60.0, "max_kept": 100, "drop_after": 1}
    settings.update(overrides)

    async def refetch(key: str, value: str) -> str:
        return await source.fetch(value + "+")()

    return Refreshed(
        "test",
        refetch,
        settings["refresh_s"],
        settings["idle_s"],
        int(settings["max_kept"]),
        int(settings["drop_after"]),
        max_weight=int(settings["max_weight"]) if "max_weight" in settings else None,
        weigh=len,
    )


async def test_values_are_kept_and_refreshed_in_the_background() -> None:
    source = Source()
    kept = refreshed(source)
    assert kept.get("k") is None
    assert await kept.load("k", source.fetch("v")) == "v"
    assert kept.get("k") == "v" and len(kept) == 1
    task = asyncio.ensure_future(kept.run())
    try:
        await until(lambda: (kept.get("k") or "").startswith("v++"))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_idle_values_are_dropped_and_read_ones_kept() -> None:
    source = Source()
    kept = refreshed(source, idle_s=0.2)
    await kept.load("read", source.fetch("r"))
    await kept.load("idle", source.fetch("i"))
    task = asyncio.ensure_future(kept.run())
    try:

        async def idle_is_gone() -> None:
            while kept.get("read") is not None and len(kept) == 2:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(idle_is_gone(), WAIT_S)
        assert kept.get("read") is not None and len(kept) == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def test_a_value_that_keeps_failing_is_dropped_after_drop_after_rounds_and_logged_once() -> None:
    source = Source()
    kept = refreshed(source, drop_after=3)
    await kept.load("k", source.fetch("v"))
    source.fail = RuntimeError("cluster down")
    calls = source.calls
    logger = logging.getLogger("shardlb.router")
    lines = Lines()
    logger.addHandler(lines)
    task = asyncio.ensure_future(kept.run())
    try:
        await until(lambda: len(kept) == 0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        logger.removeHandler(lines)
    assert source.calls - calls == 3
    assert lines.lines == ["test refresh failed"]


async def test_an_outage_is_logged_once_for_every_kept_value_and_at_its_end() -> None:
    """Each kept value logged the first refresh of it that failed: an outage of the cluster wrote one
    warning per kept view (up to max_kept, per worker and per cache), and nothing when it ended.
    Now the cache logs the outage once (naming the first view that failed), once a minute at most
    while it lasts, and an info line at the first pass whose refreshes all work."""
    source = Source()
    kept = refreshed(source, max_kept=200, drop_after=1000)  # none is dropped meanwhile
    for i in range(200):
        await kept.load(f"k{i}", source.fetch(f"v{i}"))
    calls = source.calls
    with kept_lines("shardlb.router") as log:  # at every level: the end of an outage is an info line
        task = asyncio.ensure_future(kept.run())
        try:
            source.fail = RuntimeError("cluster down")
            await until(lambda: source.calls - calls >= 400)  # every value failed at least once
            source.fail = None
            back = source.calls
            await until(lambda: source.calls - back >= 400)  # a whole pass without failure
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert [(m, f.get("view")) for m, f in log.lines()] == [
        ("test refresh failed", "k0"),
        ("test refresh works again", None),
    ]


async def test_the_least_recently_read_goes_first_past_the_bound() -> None:
    source = Source()
    kept = refreshed(source, max_kept=2)
    await kept.load("a", source.fetch("a"))
    await kept.load("b", source.fetch("b"))
    assert kept.get("a") == "a"  # "b" is now the least recently read
    await kept.load("c", source.fetch("c"))
    assert (kept.get("a"), kept.get("b"), kept.get("c")) == ("a", None, "c")


async def test_a_fetch_started_earlier_never_replaces_one_started_later() -> None:
    source = Source()
    kept = refreshed(source)
    slow_source = Source()
    slow_source.gate.clear()
    slow = asyncio.ensure_future(kept.fetch("k", slow_source.fetch("old")))
    await until(lambda: slow_source.calls == 1)
    assert await kept.fetch("k", source.fetch("new")) == "new"
    slow_source.gate.set()
    assert await slow == "old"  # its caller gets what it read ...
    assert kept.get("k") == "new"  # ... but the kept copy stays the later one


async def test_forget_drops_the_values_named_and_keeps_none_read_before_it() -> None:
    source = Source()
    kept = refreshed(source)
    for key in ("a:1", "a:2", "b:1"):
        await kept.load(key, source.fetch(f"{key} old"))
    slow_source = Source()
    slow_source.gate.clear()
    slow = asyncio.ensure_future(kept.load("a:3", slow_source.fetch("a:3 old")))  # begun before
    await until(lambda: slow_source.calls == 1)
    kept.forget(lambda key: key.startswith("a:"))
    assert kept.get("a:1") is None and kept.get("a:2") is None and kept.get("b:1") == "b:1 old"
    # A reader after the forget does not join the fetch begun before it: it fetches anew.
    assert await kept.load("a:3", source.fetch("a:3 new")) == "a:3 new"
    slow_source.gate.set()
    assert await slow == "a:3 old"  # its caller, who asked before, gets what it read ...
    assert kept.get("a:3") == "a:3 new"  # ... which is not kept
    slow_source.gate.clear()
    late = asyncio.ensure_future(kept.fetch("a:4", slow_source.fetch("a:4 old")))
    await until(lambda: slow_source.calls == 2)
    kept.forget(lambda key: key == "a:4")
    slow_source.gate.set()
    assert await late == "a:4 old" and kept.get("a:4") is None and len(kept) == 2
    assert await kept.load("a:4", source.fetch("a:4 new")) == "a:4 new" and kept.get("a:4") == "a:4 new"


async def test_past_the_weight_budget_the_least_recently_read_go_first() -> None:
    """``max_weight`` bounds what the kept values weigh together (the top cache's rows, the
    histograms' samples), whatever their number: past it the least recently read go first, and a
    value heavier than the whole budget is handed to its caller but not kept."""
    source = Source()
    kept = refreshed(source, max_weight=6, refresh_s=3600)
    await kept.load("aa", source.fetch("aa"))
    await kept.load("bbb", source.fetch("bbb"))
    assert kept.weight == 5
    assert kept.get("aa") == "aa"  # "bbb" is now the least recently read
    await kept.load("cc", source.fetch("cc"))
    assert (kept.get("aa"), kept.get("bbb"), kept.get("cc")) == ("aa", None, "cc")
    assert kept.weight == 4
    assert await kept.load("huge", source.fetch("x" * 7)) == "x" * 7
    assert kept.get("huge") is None and kept.weight == 4
    await kept.fetch("aa", source.fetch("aaaaa"))  # a kept value that grows past the budget
    assert kept.weight <= 6 and kept.get("aa") == "aaaaa" and kept.get("cc") is None


async def test_a_refresh_that_grows_a_value_past_the_budget_drops_it() -> None:
    source = Source()
    kept = refreshed(source, max_weight=5)  # the refetch appends "+" every 0.01 s
    await kept.load("a", source.fetch("aaa"))
    seen = []
    task = asyncio.ensure_future(kept.run())
    try:
        await until(lambda: seen.append(kept.weight) is None and kept.weight == 0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert max(seen) <= 5 and kept.get("a") is None
