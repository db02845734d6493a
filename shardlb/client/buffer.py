"""``ScoreBuffer``: results posted one at a time by many tasks, sent as few large requests.

A game server finishing many matches at once would otherwise send a request per result. The buffer
keeps one lane per board with results held or in flight (dropped once it has none): a result joins
its board's lane and its caller waits; the lane sends what
it holds as one ``post_scores`` call once it holds ``max_scores`` results, or ``max_delay_ms`` after
the first result of a quiet period, whichever comes first. At most ``max_in_flight`` requests per
board are out at once; results arriving meanwhile wait for the next free one (so under load requests
get bigger rather than more numerous), and a lane whose delay ran out while every request was busy
sends as soon as one returns.

Each caller gets its own outcome (or the error of its request). A request is retried by
``post_scores`` with the same results and match ids, so a retry never counts a result twice, and a
result leaves the lane only into a request whose end it then waits for: none is dropped. A request
refused for one bad result (400/422 naming ``scores[i]``) fails that result's caller only; the rest,
of which nothing was written, are sent again without it; a batch too large for the router's body
cap (413) goes as smaller requests (``AsyncClient.post_scores``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from types import TracebackType

from shardlb.client.async_client import MAX_ITEMS, AsyncClient
from shardlb.client.errors import (
    SCORE_FIELD,
    ApiError,
    ClientClosed,
    ClientError,
    InvalidRequest,
    TransportError,
    renumbered,
)
from shardlb.client.models import MatchResult, ScoreOutcome

log = logging.getLogger("shardlb.client")
MAX_PENDING = 10 * MAX_ITEMS  # results a buffer holds unanswered, by default, before posts wait


@dataclass
class _Waiting:
    result: MatchResult
    outcome: asyncio.Future[ScoreOutcome]
    room: asyncio.Semaphore | None  # given back once the result is answered, never before


@dataclass
class _Lane:
    """One board's results not yet sent, and its requests in flight."""

    waiting: list[_Waiting] = field(default_factory=list)
    in_flight: int = 0
    timer: asyncio.TimerHandle | None = None
    due: bool = False  # the delay ran out (or the buffer is closing): send as soon as a request may


class ScoreBuffer:
    """Batches ``post`` calls from many tasks into ``post_scores`` requests of up to ``max_scores``
    (at most 1000) results or ``max_delay_ms`` of waiting, per board.

    ``deadline`` is each batch's (default: the client's), the requests its refused results make
    it send again included; a caller waits for its batch to leave (at most ``max_delay_ms`` unless
    every request is busy) and then for that batch. ``close()``
    (or leaving ``async with``) sends everything held and waits for it. Cancelling a waiting
    caller does not take its result back: it is sent all the same, and should its request fail,
    the error is logged (logger ``shardlb.client``, naming the player and match). At most
    ``max_pending`` results (10,000 by default) are held unanswered, a cancelled caller's among
    them until its result is answered; past that a ``post`` waits for room before its result is
    taken (cancelled then, it was not).
    """

    def __init__(
        self,
        client: AsyncClient,
        *,
        max_scores: int = 500,
        max_delay_ms: float = 20.0,
        max_in_flight: int = 4,
        deadline: float | None = None,
        max_pending: int = MAX_PENDING,
    ) -> None:
        if not 1 <= max_scores <= MAX_ITEMS:
            raise ValueError(f"max_scores must be 1 to {MAX_ITEMS}")
        if max_delay_ms < 0 or max_in_flight < 1:
            raise ValueError("max_delay_ms must be at least 0 and max_in_flight at least 1")
        if max_pending < max_scores:
            raise ValueError("max_pending must be at least max_scores")
        self.client = client
        self.max_scores = max_scores
        self.max_delay = max_delay_ms / 1000
        self.max_in_flight = max_in_flight
        self.deadline = deadline
        self._lanes: dict[str, _Lane] = {}
        self._requests: set[asyncio.Task[None]] = set()
        self._closed = False
        # Results held and not yet answered, all lanes: past max_pending a post waits for room, so a
        # router that refuses writes for a while makes callers wait rather than the buffer grow.
        self._room = asyncio.Semaphore(max_pending)
        self._entering = 0  # posts let in before close() that wait for room

    async def __aenter__(self) -> ScoreBuffer:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.close()

    async def post(self, board: str, result: MatchResult) -> ScoreOutcome:
        """Add one result; returns its outcome once the request that carried it is answered."""
        if self._closed:
            raise ClientClosed("this ScoreBuffer is closed: nothing was sent")
        self._entering += 1
        try:
            await self._room.acquire()  # cancelled here, the result was never taken
        finally:
            self._entering -= 1
        outcome: asyncio.Future[ScoreOutcome] = asyncio.get_running_loop().create_future()
        lane = self._lanes.setdefault(board, _Lane())
        # The room is the result's, not the caller's: a cancelled caller's result is still sent,
        # so its room comes back only when the result is answered.
        lane.waiting.append(_Waiting(result, outcome, self._room))
        self._send_what_is_ready(board, lane)
        return await outcome

    async def close(self) -> None:
        """Send every result held, and return when every request has ended. Cancelled, it stops
        waiting; the requests go on for their callers (a later ``close()`` waits for them)."""
        self._closed = True
        for board, lane in list(self._lanes.items()):
            lane.due = True
            self._send_what_is_ready(board, lane)
        while self._requests or self._entering:
            if self._requests:
                # Shielded: a cancelled close() (a wait_for running out) must not cancel the
                # requests, which are their callers' and carry results that may be half applied.
                await asyncio.shield(asyncio.gather(*self._requests, return_exceptions=True))
            else:  # posts let in before closing still wait for room: theirs comes as requests end
                await asyncio.sleep(0.001)
            for board, lane in list(self._lanes.items()):
                lane.due = True
                self._send_what_is_ready(board, lane)

    def _send_what_is_ready(self, board: str, lane: _Lane) -> None:
        while lane.in_flight < self.max_in_flight and (
            len(lane.waiting) >= self.max_scores or (lane.due and lane.waiting)
        ):
            batch, lane.waiting = lane.waiting[: self.max_scores], lane.waiting[self.max_scores :]
            lane.in_flight += 1
            request = asyncio.create_task(self._request(board, lane, batch))
            self._requests.add(request)
            request.add_done_callback(self._requests.discard)
        if not lane.waiting:
            lane.due = self._closed
            if lane.timer is not None:
                lane.timer.cancel()
                lane.timer = None
            if not lane.in_flight and self._lanes.get(board) is lane:
                del self._lanes[board]  # nothing held: a board posted to once costs nothing after
        elif lane.timer is None and not lane.due:
            lane.timer = asyncio.get_running_loop().call_later(self.max_delay, self._delay_over, board)

    def _delay_over(self, board: str) -> None:
        lane = self._lanes[board]
        lane.timer = None
        lane.due = True
        self._send_what_is_ready(board, lane)

    async def _request(self, board: str, lane: _Lane, batch: list[_Waiting]) -> None:
        # One deadline for the batch, whatever its refused results make it send again.
        end = time.monotonic() + (self.client.deadline if self.deadline is None else self.deadline)
        try:
            while batch:
                left = end - time.monotonic()
                if left <= 0:
                    raise TransportError(f"POST /v1/boards/{board}/scores: no answer (deadline passed)", 1)
                try:
                    outcomes = await self.client.post_scores(board, [w.result for w in batch], deadline=left)
                except ClientError as e:
                    # A batch the client split (past the size a 413 taught it) went as several
                    # requests: those before the one that failed were applied, and their callers
                    # get their outcomes, not the error, and are not sent again (until 2026-12-05
                    # they got the error, or, after a refused value, were sent a second time).
                    done = len(e.applied)
                    for waiting, outcome in zip(batch[:done], e.applied, strict=True):
                        _settle(waiting, outcome)
                    batch = batch[done:]
                    bad = _bad_index(e, done + len(batch)) if isinstance(e, ApiError) else None
                    if not isinstance(e, ApiError) or bad is None or bad < done:
                        raise
                    # Nothing of a refused request was written: its caller gets the error, as if it
                    # had posted alone, and the others go again without it.
                    _settle(batch.pop(bad - done), error=_as_single(e))
                    continue
                for waiting, outcome in zip(batch, outcomes, strict=True):
                    _settle(waiting, outcome)
                batch = []
        except ClientError as e:
            for waiting in batch:
                _settle(waiting, error=e)
        except BaseException as e:
            # Never leave a caller waiting forever, whatever went wrong (a cancelled task included).
            for waiting in batch:
                _settle(waiting, error=e)
            raise
        finally:
            lane.in_flight -= 1
            self._send_what_is_ready(board, lane)


def _settle(
    waiting: _Waiting,
    outcome: ScoreOutcome | None = None,
    error: BaseException | None = None,
) -> None:
    if waiting.room is not None:
        waiting.room.release()
        waiting.room = None
    future = waiting.outcome
    if future.done():  # its caller was cancelled and no longer waits: the log is all that can hear
        if error is not None and not isinstance(error, asyncio.CancelledError):
            result = waiting.result
            log.warning(
                "a result whose caller was cancelled was not applied (player %s, match %s): %s",
                result.player_id,
                result.match_id,
                error,
            )
        return
    if isinstance(error, asyncio.CancelledError):
        future.cancel()
    elif error is not None:
        future.set_exception(error)
    elif outcome is not None:
        future.set_result(outcome)


def _bad_index(error: ApiError, size: int) -> int | None:
    """The index of the one result a 400/422 refused the request for, when the error names one."""
    if not isinstance(error, InvalidRequest) or error.status not in (400, 422) or error.field is None:
        return None
    match = SCORE_FIELD.fullmatch(error.field)
    if match is None or int(match[1]) >= size:
        return None
    return int(match[1])


def _as_single(error: ApiError) -> ApiError:
    """The error as the caller's own request of one score would have had it (``scores[0]...``)."""
    return renumbered(error, lambda _: 0)
