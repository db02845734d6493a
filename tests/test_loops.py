"""shardlb/loops.py: a kept loop is the running one, and is looked up again once it stopped."""

from __future__ import annotations

import asyncio

import pytest

from shardlb.loops import LoopRef


def test_the_kept_loop_is_the_running_one_in_every_new_loop() -> None:
    ref = LoopRef()

    async def seen() -> tuple[asyncio.AbstractEventLoop, asyncio.AbstractEventLoop]:
        return ref.get(), asyncio.get_running_loop()

    for _ in range(3):  # a new loop each time: the kept one stopped with its asyncio.run
        kept, running = asyncio.run(seen())
        assert kept is running
    with pytest.raises(RuntimeError):
        ref.get()  # no loop runs here: as asyncio.get_running_loop
