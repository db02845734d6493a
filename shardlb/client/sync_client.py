"""``Client``: ``AsyncClient``'s calls for code without an event loop (scripts, threaded servers).

It is a thin wrapper: it starts one event loop in a background thread (anyio's blocking portal) and
runs each ``AsyncClient`` call there, blocking the calling thread until it ends, so retries,
deadlines and connection pooling are the async client's. It may be shared by many threads, but not
called from inside a running event loop (use ``AsyncClient`` there), nor from a process forked after
it was made: the loop's thread is the parent's alone, so there its calls are ``ClientClosed`` (a
pre-forking server makes its clients in each worker).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import ExitStack
from functools import partial
from types import TracebackType
from typing import Any, TypeVar

from anyio.from_thread import start_blocking_portal

from shardlb.client.async_client import MAX_ITEMS, AsyncClient
from shardlb.client.buffer import MAX_PENDING, ScoreBuffer
from shardlb.client.errors import ClientClosed
from shardlb.client.models import BoardInfo, Entry, MatchResult, Page, PlayerRank, ScoreOutcome

T = TypeVar("T")

_MADE: weakref.WeakSet[Client] = weakref.WeakSet()  # every open Client, for a forked child to drop


def _forget_after_fork() -> None:
    """In a forked child: drop the parent's clients without closing them. Closing waits for the
    loop thread, which the child does not have; at exit it waited for good."""
    for client in list(_MADE):
        client._finalizer.detach()


os.register_at_fork(after_in_child=_forget_after_fork)


class Client:
    """Takes ``AsyncClient``'s arguments; every method is the async one's (same arguments, same
    results and errors), blocking. ``aio`` is the ``AsyncClient`` underneath. Close it with
    ``close()`` or ``with Client(...) as client:``."""

    def __init__(self, base_url: str, key: str | None = None, **options: Any) -> None:
        self.aio = AsyncClient(base_url, key, **options)
        self._exit = ExitStack()
        self._portal = self._exit.enter_context(start_blocking_portal())
        self._exit.callback(self._portal.call, self.aio.aclose)
        # A client left open is closed when it is collected, or at exit (atexit runs while the
        # loop's thread still does): left to the interpreter's last collection, the portal was
        # stopped when its thread no longer ran, and the process never exited.
        self._finalizer = weakref.finalize(self, self._exit.close)
        self._pid = os.getpid()
        _MADE.add(self)

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._finalizer()  # once: a second close does nothing

    def _run(self, call: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``call`` run in the portal's loop. After ``close()`` the portal is gone and would raise
        its own RuntimeError: a call on a closed client is the client's error, like any other."""
        if self._pid != os.getpid():
            raise ClientClosed(f"the client was made in process {self._pid}, before a fork: make one here")
        if not self._finalizer.alive:
            raise ClientClosed("the client is closed")
        return self._portal.call(call, *args)

    def post_scores(
        self, board: str, results: Iterable[MatchResult], *, deadline: float | None = None
    ) -> list[ScoreOutcome]:
        return self._run(partial(self.aio.post_scores, board, list(results), deadline=deadline))

    def top(
        self,
        board: str,
        limit: int = 100,
        *,
        period: str | None = None,
        region: str | None = None,
        rank_mode: str | None = None,
        deadline: float | None = None,
    ) -> Page:
        call = partial(
            self.aio.top, board, limit, period=period, region=region, rank_mode=rank_mode, deadline=deadline
        )
        return self._run(call)

    def entries(
        self,
        board: str,
        offset: int = 0,
        limit: int = 100,
        *,
        period: str | None = None,
        region: str | None = None,
        rank_mode: str | None = None,
        deadline: float | None = None,
    ) -> Page:
        call = partial(
            self.aio.entries,
            board,
            offset,
            limit,
            period=period,
            region=region,
            rank_mode=rank_mode,
            deadline=deadline,
        )
        return self._run(call)

    def iter_entries(
        self,
        board: str,
        *,
        period: str | None = None,
        region: str | None = None,
        rank_mode: str | None = None,
        start: int = 0,
        page_size: int = MAX_ITEMS,
        deadline: float | None = None,
    ) -> Iterator[Entry]:
        pages = self.aio.iter_entries(
            board,
            period=period,
            region=region,
            rank_mode=rank_mode,
            start=start,
            page_size=page_size,
            deadline=deadline,
        )
        try:
            while True:
                try:
                    yield self._run(pages.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            # After close() there is nothing left to close: the portal's loop closed ``pages``
            # when it stopped (an event loop finalises its unfinished async generators).
            if self._finalizer.alive:
                self._portal.call(pages.aclose)

    def player(
        self,
        board: str,
        player_id: str,
        *,
        period: str | None = None,
        region: str | None = None,
        estimate: bool = False,
        max_age_ms: int | None = None,
        rank_mode: str | None = None,
        deadline: float | None = None,
    ) -> PlayerRank:
        call = partial(
            self.aio.player,
            board,
            player_id,
            period=period,
            region=region,
            estimate=estimate,
            max_age_ms=max_age_ms,
            rank_mode=rank_mode,
            deadline=deadline,
        )
        return self._run(call)

    def around(
        self,
        board: str,
        player_id: str,
        radius: int = 5,
        *,
        period: str | None = None,
        region: str | None = None,
        rank_mode: str | None = None,
        deadline: float | None = None,
    ) -> list[Entry]:
        call = partial(
            self.aio.around,
            board,
            player_id,
            radius,
            period=period,
            region=region,
            rank_mode=rank_mode,
            deadline=deadline,
        )
        return self._run(call)

    def query(
        self,
        board: str,
        player_ids: Iterable[str],
        *,
        period: str | None = None,
        region: str | None = None,
        rank_mode: str | None = None,
        deadline: float | None = None,
    ) -> list[Entry]:
        call = partial(
            self.aio.query,
            board,
            list(player_ids),
            period=period,
            region=region,
            rank_mode=rank_mode,
            deadline=deadline,
        )
        return self._run(call)

    def put_board(self, board: str, *, deadline: float | None = None, **settings: Any) -> BoardInfo:
        return self._run(partial(self.aio.put_board, board, deadline=deadline, **settings))

    def get_board(self, board: str, *, deadline: float | None = None) -> BoardInfo:
        return self._run(partial(self.aio.get_board, board, deadline=deadline))

    def list_boards(self, *, deadline: float | None = None) -> list[BoardInfo]:
        return self._run(partial(self.aio.list_boards, deadline=deadline))

    def delete_board(self, board: str, *, deadline: float | None = None) -> None:
        self._run(partial(self.aio.delete_board, board, deadline=deadline))

    def buffer(
        self,
        *,
        max_scores: int = 500,
        max_delay_ms: float = 20.0,
        max_in_flight: int = 4,
        deadline: float | None = None,
        max_pending: int = MAX_PENDING,
    ) -> BlockingScoreBuffer:
        """A ``ScoreBuffer`` for threads: each thread's ``post`` blocks until its result is applied,
        and the results of many threads go out together (the async buffer's arguments)."""
        buffer = ScoreBuffer(
            self.aio,
            max_scores=max_scores,
            max_delay_ms=max_delay_ms,
            max_in_flight=max_in_flight,
            deadline=deadline,
            max_pending=max_pending,
        )
        return BlockingScoreBuffer(self, buffer)


class BlockingScoreBuffer:
    """``ScoreBuffer.post`` and ``close`` for threads (made by ``Client.buffer``)."""

    def __init__(self, client: Client, buffer: ScoreBuffer) -> None:
        self._client = client
        self._buffer = buffer

    def post(self, board: str, result: MatchResult) -> ScoreOutcome:
        return self._client._run(self._buffer.post, board, result)

    def close(self) -> None:
        self._client._run(self._buffer.close)

    def __enter__(self) -> BlockingScoreBuffer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
