"""Domain errors raised by the shardlb library. No HTTP here: the router maps them in one table."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardlb.board import Result


class ShardlbError(Exception):
    """Base class of every error the library raises on purpose."""

    code = "shardlb_error"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field_name(field)


def field_name(field: object) -> str | None:
    """``field`` as an error body's ``field``: a string or None. A name taken from a client's body
    may be anything a map key can be (MessagePack keys may be bytes)."""
    if field is None or isinstance(field, str):
        return field
    if isinstance(field, bytes):
        return field.decode("utf-8", "replace")
    return str(field)


class InvalidInput(ShardlbError):
    """A value a caller passed is malformed or out of range; nothing was written."""

    code = "invalid_input"

    def __init__(self, message: str, field: str | None = None, code: str | None = None) -> None:
        super().__init__(message, field)
        if code is not None:
            self.code = code


GUESSED_NAME_MAX = 64  # longer unknown names are not compared with the known ones (difflib's cost)


def unknown_field(name: object, known: Iterable[str], at: str = "") -> InvalidInput:
    """422 ``unknown_field`` for a body's key ``name`` that is none of ``known``, at ``at`` (a
    prefix of the error's field, e.g. ``scores[3].``). The message adds the known name closest to it,
    when one is close (``unknown field 'score' (did you mean 'scores'?)``): a misspelt key is the
    usual cause, and a client fixing it should not need the docs to find the right one."""
    said = field_name(name)
    message = f"unknown field {said!r}"
    if said is not None and len(said) <= GUESSED_NAME_MAX:
        close = difflib.get_close_matches(said, sorted(known), n=1, cutoff=0.6)
        if close:
            message += f" (did you mean {close[0]!r}?)"
    return InvalidInput(message, f"{at}{said}" if at else said, "unknown_field")


class OutOfRange(InvalidInput):
    """A points or time value does not fit the board's score codec."""

    code = "out_of_range"


class BoardNotFound(ShardlbError):
    code = "board_not_found"
    # The registry's version read just before the record was found missing (``BoardStore.get``, as
    # ``Board.record_version``); None: not read, or none yet.
    record_version: Any = None


class BoardConflict(ShardlbError):
    """A board with this id exists with other settings."""

    code = "board_conflict"


class BoardClosed(BoardConflict):
    """The board's total is closed: its season is being archived (``POST /v1/boards/{board}:archive``),
    and it takes no more results. Nothing of the call was written; once archived the board is gone."""

    code = "board_closed"


class PlayerNotFound(ShardlbError):
    code = "player_not_found"


class ClusterUnavailable(ShardlbError):
    """The cluster could not be reached or answered with an error that is not the caller's fault."""

    code = "cluster_unavailable"


class Overloaded(ShardlbError):
    """Too much work is in flight; the caller should retry after a short pause."""

    code = "overloaded"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PartlyApplied(Exception):
    """A shard call applied part of its batch: ``results`` holds the applied results' outcomes in
    the batch's order, None for each result that ``error`` kept out (nothing of it was written).

    Board.apply_shard raises it when the second call of pinned results (write.lua's ``p``) fails
    after the first call applied the rest: those are on the board and journaled, so their callers
    are answered with them, and only the held-back results fail with ``error``; their retry is safe
    (they carry their pinned time, so a retry lands where they would have)."""

    def __init__(self, results: list[Result | None], error: Exception) -> None:
        super().__init__(
            f"{sum(r is None for r in results)} of {len(results)} results not applied: {error!r}"
        )
        self.results = results
        self.error = error


class NotAcknowledged(ClusterUnavailable):
    """A write was applied on its shard's primary, but no replica confirmed it in time (the
    ``replica`` acknowledgement level): it could still be lost in a failover. Retrying is safe."""


class SettlementNotFound(BoardNotFound):
    code = "settlement_not_found"


class SettlementConflict(BoardConflict):
    """A settlement that cannot go on as asked: its id names another period or reward table, the
    period is not closed yet or was settled under another id, or Redis and PostgreSQL disagree."""

    code = "settlement_conflict"

    def __init__(self, message: str, field: str | None = None, code: str | None = None) -> None:
        super().__init__(message, field)
        if code is not None:
            self.code = code


class ArchiveUnprepared(ShardlbError):
    """PostgreSQL lacks a table or column of the archive's schema that a rebuild or reconcile reads:
    no archiver of this version has connected to that database (the archiver sets the schema up,
    shardlb/archive.py ``connect_db``; a rebuild's connection may have no right to). Nothing was
    done; start one, or check the PostgreSQL URL. A router answers it as PostgreSQL failing."""

    code = "archive_unavailable"
    retry_after = 5.0


class ArchiveBehind(Overloaded):
    """The archiver has not yet copied every journaled result of a frozen period into PostgreSQL:
    retry once it has (the settlement has changed nothing that a retry would repeat)."""

    code = "archive_behind"


class Resharding(Overloaded):
    """The board's layout is changing (shardlb/reshard.py): this call was refused or read a layout
    that is no longer current. Nothing was written; the caller fetches the board again and retries."""

    code = "board_resharding"


class Rebuilding(Overloaded):
    """Some of the board's shards lost their data in Redis and are not rebuilt yet (all of Redis
    lost: `shardlb rebuild --all` restored the board and has not swapped them in yet; one shard's
    slot lost alone: nothing rebuilds it until `shardlb rebuild BOARD --shard N`), and this call's
    answer depends on one: it would be inexact (an empty top, a rank from half the shards, a
    write's total against an empty shard). Nothing was written; retry once it is rebuilt."""

    code = "board_rebuilding"
