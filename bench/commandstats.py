"""Where the store's time goes in a phase: Redis's own account of its commands.

``INFO commandstats`` keeps, per command, how many calls each node ran and the microseconds it spent
running them (``calls``, ``usec``). A snapshot of every node of the cluster before a phase and one
after give the commands the phase cost the store, summed over masters and replicas: the profile
beside the phase's store CPU per operation (bench/procs.py, from /proc), whose remainder is what
Redis spent outside commands (reading and writing sockets, parsing, the event loop, replication).

Scripts are in it twice: EVALSHA's time includes the commands a script calls, and Redis 7 also
counts those under their own names. The report (``profile_lines``) lists both and says so.
No ``CONFIG RESETSTAT``: the snapshots are subtracted, so phases and other readers of the counters
do not disturb each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import redis

Counts = dict[str, tuple[int, int]]  # command -> (calls, usec), summed over the nodes

TOP = 8  # commands shown per table, by time per operation


def nodes(url: str) -> list[tuple[str, int, str | None]]:
    """The (host, port, password) of every node named in a cluster URL (``LocalCluster.url``:
    redis://[:password@]host:port,host:port,...)."""
    parts = urlsplit(url)
    auth, _, hosts = parts.netloc.rpartition("@")
    password = unquote(auth.partition(":")[2]) or None if auth else None
    out = []
    for item in hosts.split(","):
        host, _, port = item.rpartition(":")
        out.append((host, int(port), password))
    return out


def snapshot(url: str) -> Counts:
    """Calls and microseconds per command, summed over every node of ``url`` that answers (a node
    that does not, a killed one say, is left out of both snapshots' sums alike only if it stays
    down: a phase that loses a node reads its counters as gone)."""
    total: Counts = {}
    for host, port, password in nodes(url):
        client = redis.Redis(host=host, port=port, password=password, socket_timeout=5)
        try:
            with contextlib.suppress(redis.RedisError, OSError):
                for name, stats in client.info("commandstats").items():
                    command = name.removeprefix("cmdstat_")
                    calls, usec = total.get(command, (0, 0))
                    total[command] = (calls + int(stats["calls"]), usec + int(stats["usec"]))
        finally:
            client.close()
    return total


def delta(before: Counts, after: Counts) -> dict[str, dict[str, int]]:
    """What ran between the snapshots: {command: {"calls", "usec"}}, commands that ran only."""
    out = {}
    for command, (calls, usec) in after.items():
        c0, u0 = before.get(command, (0, 0))
        if calls > c0:
            out[command] = {"calls": calls - c0, "usec": max(0, usec - u0)}
    return out


class CommandMeter:
    """``start()`` and ``stop()`` around a phase; ``stop`` returns ``delta``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.before: Counts = {}

    def start(self) -> CommandMeter:
        self.before = snapshot(self.url)
        return self

    def stop(self) -> dict[str, dict[str, int]]:
        return delta(self.before, snapshot(self.url))


def per_op(commands: Mapping[str, Mapping[str, int]], ops: float) -> dict[str, tuple[float, float]]:
    """{command: (calls per operation, µs per operation)}."""
    if ops <= 0:
        return {}
    return {c: (v["calls"] / ops, v["usec"] / ops) for c, v in commands.items()}


SCRIPTS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")


def profile_lines(columns: Sequence[tuple[str, Mapping[str, Any] | None, float, float | None]]) -> list[str]:
    """A Markdown table: per column (name, the phase's ``commands``, its operations, its store CPU µs
    per operation from /proc), the commands that cost the most time per operation in any column, as
    "µs (calls)" per operation, then the store CPU per operation. Scripts' rows include the commands
    they call, which have rows of their own as well (Redis counts both)."""
    cols = [(name, per_op(cmds or {}, ops), cpu) for name, cmds, ops, cpu in columns if cmds and ops > 0]
    if not cols:
        return []
    weight: dict[str, float] = {}
    for _, per, _ in cols:
        for command, (_, us) in per.items():
            weight[command] = max(weight.get(command, 0.0), us)
    shown = sorted(weight, key=lambda c: -weight[c])[:TOP]
    lines = [
        "| command: µs (calls) per operation | " + " | ".join(name for name, _, _ in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for command in shown:
        cells = []
        for _, per, _ in cols:
            calls, us = per.get(command, (0.0, 0.0))
            cells.append(f"{us:.2f} ({calls:.2f})" if calls else "-")
        label = f"{command} (the commands it calls included)" if command in SCRIPTS else command
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    cpu_cells = ["-" if cpu is None else f"{cpu:.1f}" for _, _, cpu in cols]
    lines.append("| store CPU µs per operation (/proc) | " + " | ".join(cpu_cells) + " |")
    return lines
