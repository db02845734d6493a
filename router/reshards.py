"""The reshards this router's process moves, and those nobody moves: seen, and resumed.

A reshard's mover (shardlb/reshard.py) runs in the process that started it: `shardlb reshard`, or
a router, whose admin endpoint runs it in the background (``start``). One that dies (its router
restarted by a rolling deploy, a killed CLI) leaves the board in both layouts: every write adds a
member to the old shards' change sets (``chg``, no expiry) beside the new layout's copy, until a
mover comes back. Until 2026-12-05 nothing noticed.

Every ``every_s`` each worker lists the reshards under way and looks at their leases (one EXISTS
each), under the board registry's gate (router/budget.py counts its connections). One whose lease
was free at every look for ``after_s`` (a lease: a live mover refreshes it every third of one) is
abandoned: counted in /metrics, listed in /readyz, and resumed by this worker, if it may take it
(a journaled board's archive moves with it: only with SHARDLB_POSTGRES_URL). Every router that
finds it tries; the lease lets one mover run and the others give way at once
(``Resharder.run(wait=False)``). A worker tries a board again at most every ``RETRY_S``, one run a
try: a mover that keeps failing (a replica out of sync, the archiver behind, PostgreSQL down) is
logged once a try, not every few seconds.

A look reads the index of the reshards under way, which registry.lua keeps beside the registry in
the call that writes a record (``BoardStore.resharding``), and those boards' records: a few hundred
bytes, where the whole registry is 1.1 MB at 2,000 boards (until 2026-12-06 every look read it, in
every worker). Processes of the release before write records without the index, so a reshard
recorded by one during a rolling upgrade is missing from it: once every ``whole_every_s`` (60 s) one
worker of the cluster (the first to ask: a lease, ``keys.RESHARDS_LOOK``) reads the whole registry,
finds such reshards and mends the index, and every worker sees them at its next look. A reshard
recorded by a process of the release before is so seen up to a minute (and a look) later than one
of this release, then abandoned as any other. The index and the record are written in one call in
one slot, so a failover that loses the last writes loses both; the whole look also mends any
other difference (a record written by hand), within a minute.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from router import metrics
from router.gate import Gate
from shardlb import keys
from shardlb.board import Board
from shardlb.errors import BoardNotFound
from shardlb.fanout import batch
from shardlb.outage import Outage
from shardlb.reshard import LEASE_MS, Busy, Cancelled, NoReshard, Resharder, ShardsLost
from shardlb.store import BoardStore

log = logging.getLogger("shardlb.router")

MOVER_TRIES = 5
MOVER_PAUSE_S = 2.0
RETRY_S = 60.0  # how soon a worker resumes a board again that its last resume left unfinished
LISTED = 20  # abandoned boards /readyz names at most
WHOLE_EVERY_S = 60.0  # how often one worker of the cluster reads the whole registry (the docstring)


async def _move(mover: Resharder, wait: bool, tries: int = MOVER_TRIES) -> None:
    """Run the reshard; after a failure resume it up to ``tries`` times in all (each resume takes it
    from its recorded state), then leave it recorded for a POST {"resume": true}, `shardlb reshard
    --resume` or a watch that finds it abandoned. Busy: a live mover elsewhere has it. NoReshard:
    it is over since it was seen (another router's mover finished it, an operator cancelled it):
    every worker resumes from its own last look, so this is a race the watch makes, not a failure
    (until 2026-12-05 logged as one with its traceback, and tried again MOVER_TRIES times).
    ShardsLost: the mover cancelled the reshard, a shard of the old layout lost: one ERROR line
    naming the board, the shards and the rebuild to run (until 2026-12-06 "reshard stopped" with
    its traceback, then a try that found the reshard over).

    Every process's status says the mover starts (``Resharder.announce``) until a run takes the
    lease, and during the pause before a run again; once it ends, no longer (cancelled, as by the
    router's stop, its note runs out: ``STARTING_MS``)."""
    await _runs(mover, wait, tries)
    await told(mover.unannounce(), mover.board_id)


async def _runs(mover: Resharder, wait: bool, tries: int) -> None:
    for attempt in range(tries):
        await told(mover.announce(), mover.board_id)
        try:
            await mover.run(wait=wait)
            return
        except NoReshard:
            log.info("reshard over before this mover took it", extra={"fields": {"board": mover.board_id}})
            return
        except (Cancelled, BoardNotFound):
            return
        except Busy as e:  # a live mover elsewhere: the watch's (wait=False) give way unsaid, as many try
            if wait:  # an operator's, that found the lease free (router/admin.py) and lost it since
                log.info(e.message, extra={"fields": {"board": mover.board_id}})
            return
        except ShardsLost as e:  # cancelled: nothing to resume, a rebuild for the operator to run
            fields = {"board": e.board_id, "shards": list(e.shards), "run": list(e.commands)}
            # No command when every lost shard held nothing: its sentinel was written again.
            then = f"run {' and '.join(f'`{c}`' for c in e.commands)}, then reshard again"
            if not e.commands:
                then = "they held nothing archived, their sentinels written again: reshard again"
            log.error(
                "reshard cancelled: %s %s of the old layout lost %s keys (Redis lost %s); the "
                "board keeps its layout: %s",
                "shard" if len(e.shards) == 1 else "shards",
                ", ".join(map(str, e.shards)),
                "its" if len(e.shards) == 1 else "their",
                "the slot" if len(e.shards) == 1 else "their slots",
                then,
                extra={"fields": fields},
            )
            return
        except Exception:
            log.exception("reshard stopped", extra={"fields": {"board": mover.board_id, "try": attempt + 1}})
            if attempt + 1 < tries:
                await told(mover.announce(), mover.board_id)  # its run took the first one back
                await asyncio.sleep(MOVER_PAUSE_S)


async def told(note: Awaitable[None], board_id: str) -> None:
    """A mover's note of its start (``Resharder.announce``, ``unannounce``: its task's, and the
    POST's that starts it, router/admin.py), for its status alone: one that fails is logged, and the
    mover goes on (its own calls meet the same trouble, and say so). Read then, a status may say
    "none" (or "starting", up to ``reshard.STARTING_MS``) for a while."""
    try:
        await note
    except Exception as e:  # RedisError, or the cluster client's own (RedisClusterException)
        fields = {"board": board_id, "error": repr(e)}
        log.warning("reshard mover's start not noted", extra={"fields": fields})


def said(board_id: str) -> Callable[[str], None]:
    """A mover's progress lines, logged with its board."""

    def say(line: str) -> None:
        log.info(line, extra={"fields": {"board": board_id}})

    return say


class ReshardWatch:
    """Finds the reshards nobody moves (see the module docstring); ``check`` looks, ``resume``
    starts a mover for those this worker may take."""

    def __init__(
        self,
        store: BoardStore,
        gate: Gate,
        postgres_url: str = "",
        every_s: float = 5.0,
        after_s: float = LEASE_MS / 1000,
        whole_every_s: float = WHOLE_EVERY_S,
    ) -> None:
        self.store = store
        self.gate = gate
        self.postgres_url = postgres_url
        self.every_s = every_s
        self.after_s = after_s
        self.whole_every_s = whole_every_s  # the turn's lease too: the same in every worker
        self.asked_whole = -math.inf  # when this worker last asked for the whole look (monotonic)
        # (board id, the reshard's ``started_ms``) -> when its lease was first seen free. Per
        # reshard: one recorded after a cancel starts afresh, though no look saw the lease the
        # cancel held (until 2026-12-05 per board: it was abandoned at once, before its mover came).
        self.free_since: dict[tuple[str, int | None], float] = {}
        self.under_way: dict[str, Board] = {}
        self.abandoned: list[str] = []
        self.tried: dict[str, float] = {}  # board id -> when this worker last resumed it
        self.closed = False  # as JournalWatch.closed
        self.outage = Outage(log, "reshards not read", "reshards read again")
        # board id -> this router's mover (one a board): its admin endpoint's and the resumed ones.
        # The router's own, not the process's: its stop cancels them (``stop``).
        self.movers: dict[str, asyncio.Task[None]] = {}

    def start(self, mover: Resharder, wait: bool = True, tries: int = MOVER_TRIES) -> bool:
        """Run ``mover`` in the background, unless this router runs one of the board already;
        whether it did. ``wait``: for a lease another process holds (a resume asked for), else give
        way to it; ``tries``: runs after failures (``_move``). None once the router stops: ``stop``
        would not cancel it (a request answered while it drains started one until 2026-12-05,
        moving the board on the closed client); the reshard is recorded, and a router that runs on
        resumes it."""
        if self.closed:
            fields = {"board": mover.board_id}
            log.info("router stopping: reshard left to the routers", extra={"fields": fields})
            return False
        self.movers = {b: task for b, task in self.movers.items() if not task.done()}
        if mover.board_id in self.movers:
            return False
        self.movers[mover.board_id] = asyncio.create_task(_move(mover, wait, tries))
        return True

    def moving(self, board_id: str) -> bool:
        """Whether this router runs a mover of the board that has not ended: one that may not hold
        the board's lease yet (just started, or waiting to run again after a failure: ``_move``)."""
        task = self.movers.get(board_id)
        return task is not None and not task.done()

    async def stop(self) -> None:
        """Cancel this router's movers (as a killed process would lose them; their leases run out
        and a router that runs on resumes the reshards, see the module docstring; one that seals
        lets the old layout take writes again first, Resharder._seal). Until
        2026-12-05 they were the process's: a router's stop left them moving on the client it
        closed, reconnecting connections nobody closed."""
        self.closed = True
        for task in self.movers.values():
            task.cancel()
        await asyncio.gather(*self.movers.values(), return_exceptions=True)
        self.movers.clear()

    async def check(self) -> list[str]:
        """Look at every reshard's lease once; keep and return the abandoned ones."""
        async with self.gate, metrics.redis_call("reshards"):
            boards = await self.store.resharding(whole=await self._whole_turn())
            leases = batch(self.store.client)
            for board in boards:
                leases.execute_command("EXISTS", keys.lease_key(board.config.id))
            held = await leases.execute() if boards else []
        now = time.monotonic()
        free = [(b.config.id, b.reshard_ms) for b, leased in zip(boards, held, strict=True) if not leased]
        self.free_since = {reshard: self.free_since.get(reshard, now) for reshard in free}
        self.under_way = {b.config.id: b for b in boards}
        abandoned = sorted(b for (b, _), since in self.free_since.items() if now - since >= self.after_s)
        for board_id in set(abandoned) - set(self.abandoned):
            log.warning("reshard abandoned: no mover holds its lease", extra={"fields": {"board": board_id}})
        self.abandoned = abandoned
        metrics.RESHARDS_UNDER_WAY.set(len(boards))
        metrics.RESHARDS_ABANDONED.set(len(abandoned))
        return abandoned

    async def _whole_turn(self) -> bool:
        """Whether this look reads the whole registry (the module docstring): this worker asks once
        every ``whole_every_s``, and takes the turn if no worker of the cluster took it for as long."""
        now = time.monotonic()
        if now - self.asked_whole < self.whole_every_s:
            return False
        self.asked_whole = now
        lease_ms = max(1, int(self.whole_every_s * 1000))
        return bool(await self.store.client.set(keys.RESHARDS_LOOK, 1, nx=True, px=lease_ms))

    def resume(self) -> list[str]:
        """Start a mover for each abandoned reshard this worker may take; return their boards."""
        now = time.monotonic()
        started = []
        for board_id in self.abandoned:
            journaled = self.under_way[board_id].config.durability == "journal"
            if journaled and not self.postgres_url:
                continue
            if board_id in self.tried and now - self.tried[board_id] < RETRY_S:
                continue
            self.tried[board_id] = now
            log.warning("resuming an abandoned reshard", extra={"fields": {"board": board_id}})
            # One run a try: the watch's next try is its retry (until 2026-12-05 each try was
            # MOVER_TRIES runs 2 s apart, each failure an error line: five in 8 s every minute).
            mover = Resharder(self.store, board_id, said(board_id), self.postgres_url or None)
            self.start(mover, wait=False, tries=1)
            started.append(board_id)
        self.tried = {b: at for b, at in self.tried.items() if b in self.under_way}
        return started

    def body(self) -> dict[str, Any]:
        """For /readyz: the reshards under way, and the boards of those abandoned (``LISTED``)."""
        return {"under_way": len(self.under_way), "abandoned": self.abandoned[:LISTED]}

    async def run(self) -> None:
        while not self.closed:
            try:
                await self.check()
                self.resume()
            except Exception as e:  # the cluster is in trouble: /readyz says so on its own
                self.outage.failed(e)
            else:
                self.outage.succeeded()
            if not self.closed:
                await asyncio.sleep(self.every_s)
