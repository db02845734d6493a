"""What durability costs, measured in the same run as everything else: a board whose journal the
archiver drains into PostgreSQL beside a ``durability: memory`` board, and writes acknowledged by a
replica (router setting SHARDLB_ACK=replica) beside writes acknowledged by the primary.

``bench.run`` drives the phases; this module holds what only the durability phases need: the
archive's PostgreSQL (a private server, or SHARDLB_POSTGRES_URL), the archiver as a process of its
own (``shardlb archive``, metered like the router), the journals' state before and after a
phase (entries added, lag), the wait until the archive has caught up, and whether the router knows
the ``ack`` setting at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import psycopg

from bench.harness import log
from bench.procs import CpuMeter
from bench.services import stop_group
from bench.testbed import postgres_pids
from shardlb import keys
from shardlb.connection import Scripts, connect
from shardlb.journal import journal_lag
from shardlb.postgres import LocalPostgres

ROOT = Path(__file__).resolve().parent.parent
DRAIN_POLL_S = 0.5


def router_knows(setting: str) -> bool:
    """Whether the router reads ``SHARDLB_<SETTING>``: it ignores variables it does not know, so a
    phase that sets an unknown one would silently measure the default instead."""
    from router.settings import Settings

    return setting in {f.name for f in fields(Settings)}


@dataclass
class ArchiveDatabase:
    """The PostgreSQL the archiver writes to: SHARDLB_POSTGRES_URL, or a private server in ``dir``
    (kept with fsync on, as `make run` keeps it: the archive is the source of truth)."""

    dir: Path
    url: str = ""
    server: LocalPostgres | None = None

    def up(self) -> ArchiveDatabase:
        self.url = os.environ.get("SHARDLB_POSTGRES_URL", "")
        if not self.url:
            self.server = LocalPostgres(self.dir)
            self.url = self.server.up()
        return self

    def pids(self) -> list[int]:
        """The server's postmaster (its backends are its children), or, for a server named by
        SHARDLB_POSTGRES_URL, every PostgreSQL process on this machine (none when it is remote)."""
        if self.server is None:
            return postgres_pids()
        with contextlib.suppress(OSError, ValueError, IndexError):
            return [int((self.server.data / "postmaster.pid").read_text().split()[0])]
        return []

    def describe(self) -> str:
        if self.server is None:
            return "SHARDLB_POSTGRES_URL"
        return f"a private server, port {self.server.port}, fsync on"

    def archived(self, board: str) -> int:
        """Rows of ``board`` in match_results (0 before the archiver made the table)."""
        with psycopg.connect(self.url) as conn:
            found = conn.execute("SELECT to_regclass('match_results')").fetchone()
            if not found or found[0] is None:
                return 0
            row = conn.execute("SELECT count(*) FROM match_results WHERE board = %s", (board,)).fetchone()
            return int(row[0]) if row else 0

    def down(self) -> None:
        if self.server is not None:
            self.server.destroy()


@dataclass
class ArchiverProcess:
    """``shardlb archive`` in its own session; SIGTERM stops it after its current round."""

    redis_url: str
    postgres_url: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ArchiverProcess:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "shardlb", "archive", "--redis", self.redis_url,
                 "--postgres", self.postgres_url, "--name", "bench"],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        return self

    @property
    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc and self.proc.poll() is None else []

    def exit_code(self) -> int | None:
        """None while it runs; an archiver that died mid-run leaves its journals undrained."""
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        stop_group(self.proc)


async def _journals(url: str, board_id: str) -> dict[str, Any]:
    """Entries ever added to the board's journals (XINFO STREAM entries-added) and their lag."""
    from shardlb.store import BoardStore

    plain = connect(url)
    raw = connect(url, decode=False)
    try:
        board = await BoardStore(plain, Scripts.register(plain)).get(board_id)
        added = lag_entries = 0
        lag_s = 0.0
        for prefix in board.prefixes:
            key = keys.journal_key(prefix)
            if not await raw.exists(key):
                continue
            info: dict[Any, Any] = await raw.xinfo_stream(key)
            added += int(info.get("entries-added") or info.get(b"entries-added") or 0)
            lag = await journal_lag(raw, key)
            lag_entries += lag.entries
            lag_s = max(lag_s, lag.seconds)
        return {"entries_added": added, "lag_entries": lag_entries, "lag_seconds": round(lag_s, 2)}
    finally:
        await plain.aclose()
        await raw.aclose()


def journals(url: str, board_id: str) -> dict[str, Any]:
    return asyncio.run(_journals(url, board_id))


@dataclass
class JournalPhase:
    """A write phase on a journaled board with the archiver running: the phase itself, the journals'
    state at its end (the archive's lag), then the wait until the archiver has caught up, metered."""

    redis_url: str
    board: str
    db: ArchiveDatabase
    groups: dict[str, list[int]]
    drain_wait_s: float
    before: dict[str, Any] = field(default_factory=dict)

    def run(self, phase: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        self.before = {**journals(self.redis_url, self.board), "archived": self.db.archived(self.board)}
        result = phase()
        at_end = {**journals(self.redis_url, self.board), "archived": self.db.archived(self.board)}
        drain = self.drain()
        after = drain.pop("journals")
        entries = at_end["entries_added"] - self.before["entries_added"]
        archived = after["archived"] - self.before["archived"]
        result["journal"] = {
            "entries_added": entries,
            "results_archived": archived,
            "results_per_entry": round(archived / entries, 1) if entries else None,
            "lag_entries_at_end": at_end["lag_entries"],
            "lag_seconds_at_end": at_end["lag_seconds"],
            "archived_at_end": at_end["archived"] - self.before["archived"],
            **drain,
        }
        log(
            f"journal: {entries} entries, {archived} results archived; lag at the end "
            f"{at_end['lag_entries']} entries / {at_end['lag_seconds']} s; drained in {drain['drain_s']} s"
        )
        return result

    def drain(self) -> dict[str, Any]:
        """Wait (up to drain_wait_s) until every journal entry is archived; CPU meanwhile."""
        meter = CpuMeter(self.groups).start()
        t0 = time.monotonic()
        state = journals(self.redis_url, self.board)
        while state["lag_entries"] and time.monotonic() - t0 < self.drain_wait_s:
            time.sleep(DRAIN_POLL_S)
            state = journals(self.redis_url, self.board)
        cpu = meter.stop()
        return {
            "drained": state["lag_entries"] == 0,
            "drain_s": round(time.monotonic() - t0, 1),
            "drain_cpu": cpu,
            "journals": {**state, "archived": self.db.archived(self.board)},
        }
