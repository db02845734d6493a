"""A mend for Python 3.11's ``asyncio.wait_for``, which loses a cancellation.

On 3.11, ``wait_for`` runs its awaitable in a task of its own and waits for it. When the waiting
task is cancelled just as that inner task finishes (the inner task is done, the waiter's wake-up
not yet run), ``wait_for`` returns the inner result and drops the cancellation: the caller goes
on as if never cancelled (CPython issue gh-86296; 3.12 rebuilt ``wait_for`` on ``asyncio.timeout``).

redis-py wraps every command's write in ``wait_for`` when a socket timeout is set, as ours always
is (shardlb/connection.py). So a cancellation landing while a command was being written was lost:
`shardlb bands` stopped by SIGTERM as it sent its first command kept waiting for the answer (one
run in five in tests/test_cli.py), and a router's background loop cancelled at shutdown could go
on with its next round.

``mend_wait_for`` puts in ``asyncio`` a ``wait_for`` with 3.12's behaviour: the awaitable runs in
the caller's task under ``asyncio.timeout``, so a cancellation is never taken for a result. Each
process of ours calls it first (the CLI's ``main``, the router's app, the test suite); a program
that only imports the library keeps its own ``asyncio``. On 3.12 and later it does nothing.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

# asyncio's own, as found when this module was first imported (before any mend)
ORIGINAL_WAIT_FOR = asyncio.tasks.wait_for


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """Wait for ``aw`` for at most ``timeout`` seconds (None: for ever), as 3.12's ``wait_for``:
    TimeoutError when the time is up (``aw`` cancelled and waited for), CancelledError when the
    caller is cancelled, even at the instant ``aw`` finishes."""
    if timeout is not None and timeout <= 0:
        # Out of time already: a result already there is taken, else ``aw`` is stopped.
        task = asyncio.ensure_future(aw)
        if not task.done():
            task.cancel()
            try:
                await asyncio.wait({task})  # its cancellation runs to its end before we go on
            except asyncio.CancelledError:
                task.cancel()
                raise
            if task.cancelled():
                raise TimeoutError
        return task.result()
    async with asyncio.timeout(timeout):
        return await aw


def mend_wait_for() -> None:
    """Replace ``asyncio.wait_for`` with ``wait_for`` above on Python before 3.12."""
    if sys.version_info < (3, 12):
        mended: Any = wait_for
        asyncio.wait_for = mended
        asyncio.tasks.wait_for = mended
