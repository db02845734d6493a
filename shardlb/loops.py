"""The running event loop, kept by an object that serves one loop, instead of asked for per call.

CPython 3.11 checks ``getpid()`` in every ``asyncio.get_running_loop()`` (to notice a loop
inherited across a fork), and on a VM that is a system call of several microseconds: the write
coalescer, the script pipeline and a busy gate asked for the loop several times per request.
(Python 3.12 keeps the loop in the thread state and makes no system call.)
"""

from __future__ import annotations

import asyncio


class LoopRef:
    """The loop its owner runs on, looked up again only when the kept one is not running (an
    owner that outlives its loop, as in tests)."""

    __slots__ = ("_loop",)

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    def get(self) -> asyncio.AbstractEventLoop:
        """The running loop; call it from a coroutine or callback of that loop."""
        loop = self._loop
        if loop is None or not loop.is_running():
            loop = self._loop = asyncio.get_running_loop()
        return loop
