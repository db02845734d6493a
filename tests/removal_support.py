"""A removal's journal reads (``moderation._delete_entries``) seen through the board's client, and a
journal the archiver has not taken (tests/test_moderation.py, tests/test_rebuild.py)."""

from __future__ import annotations

from typing import Any

from shardlb.board import Board


async def filled(raw: Any, key: str, count: int) -> None:
    """``count`` write entries (no `x`) added to the journal ``key``: the archiver behind."""
    pipe = raw.pipeline(transaction=False)
    for n in range(count):
        pipe.execute_command("XADD", key, "*", "b", "filler", "n", "1", "r", b"\x90" * 8)
        if n % 5000 == 4999:
            await pipe.execute()
    await pipe.execute()


class JournalReads:
    """Wraps the board's client: counts the XRANGE calls and the entries and bytes they return."""

    def __init__(self, board: Board) -> None:
        self.calls = self.entries = self.bytes = 0
        self.original = board.client.execute_command

        async def counted(*args: Any, **options: Any) -> Any:
            got = await self.original(*args, **options)
            if args and args[0] == "XRANGE":
                self.calls += 1
                self.entries += len(got or ())
                self.bytes += sum(len(i) + sum(len(k) + len(v) for k, v in f.items()) for i, f in got or ())
            return got

        board.client.execute_command = counted  # type: ignore[method-assign]
