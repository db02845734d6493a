"""shardlb.compat.wait_for keeps a cancellation that meets its awaitable finishing, which Python
3.11's asyncio.wait_for drops (the race that made `shardlb bands` ignore a SIGTERM landing as it
wrote its first command: tests/test_cli.py::test_sigterm_stops_a_one_shot_command_with_one_line).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from shardlb import compat

STDLIB_WAIT_FOR = compat.ORIGINAL_WAIT_FOR if sys.version_info < (3, 12) else None
WaitFor = Callable[[Awaitable[Any], float | None], Awaitable[Any]]


async def _cancelled_as_the_inner_task_ends(wait_for: WaitFor) -> str:
    """Cancel the waiting task from the inner task's own done-callback, the instant it finishes;
    return what the waiting task then did."""
    went_on = asyncio.Event()

    async def inner() -> int:
        return 7

    async def waiting() -> None:
        inner_task = asyncio.ensure_future(inner())
        inner_task.add_done_callback(lambda _: outer.cancel())
        await wait_for(inner_task, 30)
        went_on.set()  # the cancellation was taken for the result
        await asyncio.sleep(0)

    outer = asyncio.ensure_future(waiting())
    try:
        await outer
    except asyncio.CancelledError:
        return "cancelled"
    return "went on" if went_on.is_set() else "ended"


@pytest.mark.skipif(STDLIB_WAIT_FOR is None, reason="Python 3.12 mended wait_for itself")
async def test_python_311s_wait_for_loses_that_cancellation() -> None:
    """The defect, so that the mend is known to be needed (and this test says when it no longer is)."""
    assert STDLIB_WAIT_FOR is not None
    assert await _cancelled_as_the_inner_task_ends(STDLIB_WAIT_FOR) == "went on"


async def test_the_mended_wait_for_keeps_it() -> None:
    assert await _cancelled_as_the_inner_task_ends(compat.wait_for) == "cancelled"


async def test_the_mended_wait_for_times_out_and_stops_what_it_waited_for() -> None:
    stopped = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            stopped.set()

    with pytest.raises(TimeoutError):
        await compat.wait_for(slow(), 0.01)
    assert stopped.is_set()
    assert await compat.wait_for(asyncio.sleep(0, "done"), 5) == "done"
    assert await compat.wait_for(asyncio.sleep(0.01, "no limit"), None) == "no limit"


async def test_no_time_left_takes_a_result_already_there_and_stops_the_rest() -> None:
    finished: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    finished.set_result(3)
    assert await compat.wait_for(finished, 0) == 3
    waiting = asyncio.ensure_future(asyncio.sleep(30))
    with pytest.raises(TimeoutError):
        await compat.wait_for(waiting, -1)
    assert waiting.cancelled()


def test_the_cli_mends_asyncio_before_it_runs_a_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """`shardlb` processes mend asyncio first (the router's app and the suite likewise)."""
    from shardlb import cli

    if STDLIB_WAIT_FOR is None:
        pytest.skip("nothing to mend on Python 3.12")
    monkeypatch.setattr(asyncio, "wait_for", STDLIB_WAIT_FOR)
    monkeypatch.setattr(asyncio.tasks, "wait_for", STDLIB_WAIT_FOR)
    assert (
        cli.main(["bands", "b", "--count", "2", "--skew", "0.5", "--apply"]) == cli.USAGE
    )  # refused before it connects
    assert asyncio.wait_for is compat.wait_for and asyncio.tasks.wait_for is compat.wait_for
