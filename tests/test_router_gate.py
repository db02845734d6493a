"""router/gate.py: the gates in front of Redis, without a server."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.gate import Gate
from shardlb.errors import Overloaded


async def test_gate_refuses_past_its_queue_and_past_its_wait() -> None:
    gate = Gate(1, queue=1, wait_s=0.05)
    await gate.acquire()
    waiter = asyncio.ensure_future(gate.acquire())
    await asyncio.sleep(0)
    assert gate.waiting == 1
    with pytest.raises(Overloaded):
        await gate.acquire()  # the queue is full: refused at once
    start = time.monotonic()
    with pytest.raises(Overloaded):
        await waiter  # nobody released within wait_s
    assert time.monotonic() - start < 1 and gate.waiting == 0 and gate.held == 1
    gate.release()
    assert gate.held == 0


async def test_gate_serves_in_order_and_loses_no_permit_to_cancellation() -> None:
    gate = Gate(1, wait_s=5)
    await gate.acquire()
    order: list[int] = []

    async def take(i: int) -> None:
        await gate.acquire()
        order.append(i)
        gate.release()

    first, doomed, last = (asyncio.ensure_future(take(i)) for i in range(3))
    await asyncio.sleep(0)
    doomed.cancel()  # gives up while waiting
    await asyncio.sleep(0)
    gate.release()
    await asyncio.gather(first, last)
    assert order == [0, 2] and gate.held == 0 and gate.waiting == 0

    # A permit handed over in the same tick as a cancellation goes on to the next waiter.
    await gate.acquire()
    handed, next_in_line = asyncio.ensure_future(gate.acquire()), asyncio.ensure_future(gate.acquire())
    await asyncio.sleep(0)
    gate.release()
    handed.cancel()
    await asyncio.wait_for(next_in_line, 1)
    assert handed.cancelled() and gate.held == 1
    gate.release()
    assert gate.held == 0
