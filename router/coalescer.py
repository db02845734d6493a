"""The write coalescer: scores from concurrent requests, applied with one script call per shard.

Requests hand in validated scores (``Prepared``). Each score joins the queue of its (board, shard)
group. A tick closes ``delay_s`` after the first score of an idle period arrives, or at once when a
group reaches ``max_batch``; then every waiting group sends what it holds as ONE ``apply_shard``
call (up to ``max_batch`` scores); with a ``pipeline``, the calls started in one turn of the loop
leave as one pipeline per primary. A group has at most ``inflight`` calls in flight (1 by default):
scores that arrive meanwhile are sent together as soon as one returns, so under load batches grow
instead of calls. One request's scores for a shard travel in one call (unless they pass
``max_batch``), applied in the order it gave them; calls in flight together are applied in either
order, as the calls of two router processes are. A region request that names a player under
several regions is queued in rounds, each once the one before was applied (``shardlb.board.rounds``).
Each request waits for its own scores only, and gets their statuses in its order.

Back-pressure: at most ``limit`` scores may be accepted and not yet applied; a request that would pass
it is refused at once (Overloaded, 503 with Retry-After) rather than queued. A gate per cluster
primary bounds the script calls in flight to it (its share of redis-py's per-node connection cap,
router/budget.py); a group that cannot get a permit within ``wait_s`` fails its batch with 503
rather than wait on. ``close`` refuses new scores and applies everything accepted, within a time
bound (SIGTERM drain), and says what it left (``Drained``).

A failed call fails its requests (503s, a line a minute of them: router/middleware.py) and is logged as an
outage of its primary (shardlb/outage.py): at its first failure, then once a minute at most with the
count, and at the first call that works through it again, so a primary down costs a few lines
rather than one per batch; another primary's outage has lines of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from router import metrics
from router.errors import shutting_down
from router.gate import NodeGates
from shardlb.board import Board, Prepared, Result, in_rounds, rounds
from shardlb.connection import primary_name, primary_names
from shardlb.errors import Overloaded, PartlyApplied
from shardlb.fanout import ScriptPipeline
from shardlb.loops import LoopRef
from shardlb.outage import Outage

log = logging.getLogger("shardlb.router")
GAUGE_S = 0.05
GONE_CHECK_S = 1.0  # how often, at most, a call that works looks for failing primaries gone from the map


class _Ticket:
    """One request's scores: each result lands at its index (``Coalescer._answer``); the future
    resolves with all of them."""

    __slots__ = ("future", "remaining", "results")

    def __init__(self, n: int, future: asyncio.Future[list[Result]]) -> None:
        self.results: list[Result | None] = [None] * n
        self.remaining = n
        self.future = future

    def fail(self, exc: BaseException) -> None:
        # A request whose scores span shards fails as a whole on the first failed shard call; the
        # calls that did succeed stay applied (shards are not atomic together; retries are safe).
        if not self.future.done():
            self.future.set_exception(exc)


class Drained(NamedTuple):
    """What a drain that timed out left behind (zeros after a full drain). ``not_applied``: scores
    never sent (queued, or waiting for their primary's permit), certainly not applied.
    ``in_doubt``: scores of script calls sent whose answer had not come back: the cluster may have
    applied them or not, and no one can tell without reading the board. Their requests all got 503
    ``shutting_down`` (a retry is safe either way)."""

    not_applied: int
    in_doubt: int


_Item = tuple[Prepared, _Ticket, int]
_Key = tuple[str, int, int]


@dataclass(eq=False)
class _Group:
    key: _Key
    board: Board
    shard: int
    queue: deque[_Item] = field(default_factory=deque)
    running: int = 0  # calls in flight


def primary_of(board: Board, shard: int) -> str:
    """The name of the primary that serves ``shard`` of ``board`` in the client's slot map."""
    return primary_name(board.client, board.prefixes[shard])


class Coalescer:
    """Batches scores per (board, shard); see the module docstring for the rules."""

    def __init__(
        self,
        delay_s: float = 0.0015,
        max_batch: int = 500,
        limit: int = 20_000,
        node_concurrency: int = 16,
        node_of: Callable[[Board, int], str] = primary_of,
        wait_s: float = 2.0,
        pipeline: ScriptPipeline | None = None,
        inflight: int = 1,
    ) -> None:
        self.delay_s = delay_s
        self.inflight = inflight
        self.max_batch = max_batch
        self.limit = limit
        self.node_of = node_of
        self.pipeline = pipeline  # a tick's calls to one primary go out as one pipeline
        self.closing = False
        self.nodes = NodeGates(node_concurrency, wait_s, "score writes")
        self._drain_s: float | None = None  # while draining, how long a batch may wait its turn
        self._groups: dict[_Key, _Group] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._depth = 0
        self._sent = 0  # of them, in script calls sent and not answered yet
        self._gauge_at = 0.0
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop = LoopRef()
        # Primary name -> its outage, while its calls fail (dropped when it ends: bounded by the nodes).
        self._outages: dict[str, Outage] = {}
        self._gone_checked_at = 0.0

    @property
    def depth(self) -> int:
        """Scores accepted and not yet applied."""
        return self._depth

    def submit(self, board: Board, prepared: Sequence[Prepared]) -> Coroutine[Any, Any, list[Result]]:
        """Queue validated scores of one request; return their results in order once all are applied.

        Raises Overloaded at once when the queue is full, ApiError 503 when the router is closing,
        and the error of a failed shard call (scores on other shards may then have been applied).
        A region request that names a player under several regions is queued in rounds
        (``shardlb.board.rounds``): each once the round before it was applied.

        Not a coroutine itself: it hands back the one to await, which queues the scores once
        awaited (a coroutine less a write).
        """
        order = rounds(board.config.sharding, prepared)
        if order is None:
            return self._submit(board, prepared)
        return in_rounds(prepared, order, functools.partial(self._submit, board))

    async def _submit(self, board: Board, prepared: Sequence[Prepared]) -> list[Result]:
        n = len(prepared)
        self.check_room(n)
        if n == 0:
            return []
        loop = self._loop.get()
        ticket = _Ticket(n, loop.create_future())
        self._count(n)
        config = board.config
        board_id, config_id, groups = config.id, id(config), self._groups
        # The request's items by shard, in their order within each shard (``by_shard`` written out:
        # each item made once, where a generator over by_shard's positions made it again).
        items: dict[int, list[_Item]] = {}
        for i, p in enumerate(prepared):
            listed = items.get(p.shard)
            if listed is None:
                items[p.shard] = [(p, ticket, i)]
            else:
                listed.append((p, ticket, i))
        for shard, listed in items.items():
            key = (board_id, shard, config_id)
            group = groups.get(key)
            if group is None:
                group = groups[key] = _Group(key, board, shard)
            group.queue.extend(listed)
            if len(group.queue) >= self.max_batch and group.running < self.inflight:
                self._start(group)
        if self._timer is None:
            self._timer = loop.call_later(self.delay_s, self._tick)
        return await ticket.future

    def check_room(self, n: int) -> None:
        """Refuse ``n`` scores now if ``submit`` would: the router is closing (503 shutting_down), or
        they would pass the queue's bound (Overloaded). The write path asks before it does anything
        that leaves a trace (the per-minute counts of router/moderation.py), so a request refused for
        a full queue changes nothing."""
        if self.closing:
            metrics.REJECTED.labels("shutting_down").inc()
            raise shutting_down()
        if n and self._depth + n > self.limit:
            metrics.REJECTED.labels("queue_full").inc()
            raise Overloaded(f"the write queue is full ({self._depth} scores waiting); retry shortly", 1.0)

    async def close(self, timeout: float) -> Drained:
        """Refuse new scores, apply every accepted one within ``timeout`` s; return what was left."""
        self.closing = True
        self._drain_s = timeout
        self._tick()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        # Counted before the cancellation below, which moves no score from one to the other.
        left = Drained(self._depth - self._sent, self._sent)
        if self._depth:
            fields = {"scores_not_applied": left.not_applied, "scores_in_doubt": left.in_doubt}
            log.error("coalescer drain timed out", extra={"fields": fields})
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            # A cancelled call fails its own batch; the scores queued behind it are failed here, so
            # every request still waiting gets its 503 rather than no answer.
            for group in list(self._groups.values()):
                while group.queue:
                    _, ticket, _ = group.queue.popleft()
                    ticket.fail(shutting_down())
                    self._count(-1)
            self._groups.clear()
        return left

    def _tick(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        for group in list(self._groups.values()):
            if group.queue and group.running < self.inflight:
                self._start(group)

    def _start(self, group: _Group) -> None:
        group.running += 1
        task = self._loop.get().create_task(self._run(group))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, group: _Group) -> None:
        try:
            while group.queue:
                queue = group.queue
                if len(queue) <= self.max_batch:  # all of it, the usual case: taken in one step
                    batch = list(queue)
                    queue.clear()
                else:
                    take = queue.popleft
                    batch = [take() for _ in range(self.max_batch)]
                await self._apply(group, batch)
        finally:
            group.running -= 1
            if not group.queue and not group.running and self._groups.get(group.key) is group:
                del self._groups[group.key]

    async def _apply(self, group: _Group, batch: list[_Item]) -> None:
        node = self.node_of(group.board, group.shard)
        gate = self.nodes(node)
        try:
            await gate.acquire(self._drain_s)
            self._sent += len(batch)
            try:
                async with metrics.redis_call("apply"):
                    results = await group.board.apply_shard(
                        group.shard, [item[0] for item in batch], pipeline=self.pipeline
                    )
            finally:
                self._sent -= len(batch)
                gate.release()
        except PartlyApplied as e:
            # Pinned results' second call failed after the first call applied the others (see
            # PartlyApplied): those are answered; the requests of the held-back results fail.
            self._answer(batch, e.results, e.error)
            self._failed(node, group, e.results.count(None), e.error)
        except BaseException as e:
            failure = shutting_down() if isinstance(e, asyncio.CancelledError) else e
            self._answer(batch, [None] * len(batch), failure)
            if isinstance(e, asyncio.CancelledError):
                raise
            self._failed(node, group, len(batch), e)
        else:
            _batch_size(len(batch))
            self._answer(batch, results, None)
            if self._outages:
                self._worked(node, group.board)
        finally:
            self._count(-len(batch))

    def _answer(
        self, batch: list[_Item], results: Sequence[Result | None], failure: BaseException | None
    ) -> None:
        """Give each request its applied results; fail it with ``failure`` for a result left out (None)."""
        for (_, ticket, index), result in zip(batch, results, strict=True):
            if result is not None:
                # The result lands at its index; the ticket's future resolves with all of them once
                # the last one is in (written out here, not a method: a call less a score).
                ticket.results[index] = result
                ticket.remaining -= 1
                if not ticket.remaining and not ticket.future.done():
                    ticket.future.set_result([r for r in ticket.results if r is not None])
            elif failure is not None:
                ticket.fail(failure)
        # Counted by status once the batch is answered: a list's count of each of its few statuses
        # is a C loop, where a count kept in a dict cost a lookup and a store a score.
        statuses = [result.status for result in results if result is not None]
        for status in set(statuses):
            _scores(status)(statuses.count(status))

    def _failed(self, node: str, group: _Group, scores: int, error: BaseException) -> None:
        outage = self._outages.get(node)
        if outage is None:
            outage = self._outages[node] = Outage(log, "shard write failed", "shard writes work again")
        fields = {"node": node, "board": group.board.config.id, "shard": group.shard, "scores": scores}
        outage.failed(error, fields)

    def _worked(self, node: str, board: Board) -> None:
        """A call through ``node`` worked: its outage ends. So does the outage of a primary that left
        the slot map (its replica promoted; "unknown", a map being refreshed), as no call will go
        through it again: looked for at most every GONE_CHECK_S, since it reads the whole map."""
        outage = self._outages.pop(node, None)
        if outage is not None:
            outage.succeeded({"node": node})
        now = time.monotonic()
        if not self._outages or now < self._gone_checked_at:
            return
        self._gone_checked_at = now + GONE_CHECK_S
        serving = primary_names(board.client)
        for gone in [name for name in self._outages if name not in serving]:
            self._outages.pop(gone).succeeded({"node": gone, "left_slot_map": True})

    def _count(self, delta: int) -> None:
        self._depth += delta
        if self._depth:
            self._idle.clear()
            now = time.monotonic()
            if now >= self._gauge_at:  # the gauge at most every GAUGE_S while busy: it costs a lock
                self._gauge_at = now + GAUGE_S
                metrics.QUEUE_DEPTH.set(self._depth)
        else:
            self._idle.set()
            metrics.QUEUE_DEPTH.set(0)


@functools.lru_cache(maxsize=64)
def _scores(status: str) -> Callable[[float], None]:
    """The scores counter's child's inc for ``status`` (looking labels up costs more than counting)."""
    return metrics.counter(metrics.SCORES.labels(status))


_batch_size = metrics.observer(metrics.BATCH_SIZE)
