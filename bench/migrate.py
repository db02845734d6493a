"""Slot migration under load (issue 15, item 1): the `make chaos` migration table, and the code
tests/test_migration.py runs in short form.

Clients write through the HTTP API of a router process and keep a ledger of every acknowledged
result (bench/chaos.py's ``Load``), while readers page through a ``best`` board and check every
page they are given: no player twice, none missing that was acknowledged before the read began, in
the board's order. Meanwhile the cluster changes under them:

- ``add``: ``LocalCluster.add_node`` starts one more master (with ``replicas`` replicas) and
  ``rebalance`` moves a quarter of the slots, keys and all, onto it;
- ``remove``: ``remove_node`` moves the first master's slots to the others and takes it out.

A slot's keys move ``KEYS_PER_MIGRATE`` at a time with a pause after each MIGRATE, so a shard
stays half moved for a while (redis-cli moves 10 keys a call): writes to it then get TRYAGAIN
(docs/design-notes.md, "Slot migration"), which the client sees as 503 and retries. Afterwards the
boards are read back and compared with the ledger as chaos.py does.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import chaos
from bench.harness import env_int, log, run_dir
from bench.services import Router, free_port
from shardlb.cluster import LocalCluster, free_port_block

KEYS_PER_MIGRATE = 1
PAUSE_S = 0.02  # after each MIGRATE of a slot that holds keys
PAGE = 1000  # the API's largest page: the whole best board in one read
READ_PAUSE_S = 0.02
PHASES = ("add", "remove")


@dataclass
class Readers:
    """``tasks`` readers paging through ``board`` until ``stop``; each page is checked against what
    ``ledger`` held acknowledged when the read began."""

    url: str
    board: str
    ledger: chaos.Ledger
    tasks: int = 2
    checked: int = 0
    inexact: list[str] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        async with chaos.client(self.url) as http:
            await asyncio.gather(*(self._task(http) for _ in range(self.tasks)))

    async def _task(self, http: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            known = {p for (b, p) in self.ledger.best if b == self.board}
            try:
                r = await http.get(f"/v1/boards/{self.board}/entries", params={"offset": 0, "limit": PAGE})
                status = str(r.status_code)
            except httpx.HTTPError as e:
                status = type(e).__name__
            self.statuses[status] += 1
            if status == "200":
                self.checked += 1
                problem = page_problem(r.json()["entries"], known)
                if problem:
                    self.inexact.append(problem)
            await asyncio.sleep(READ_PAUSE_S)


def page_problem(entries: list[dict[str, Any]], known: set[str]) -> str | None:
    """What is wrong with a page of a whole ``desc`` board, if anything: a player shown twice, one
    acknowledged before the read missing, ranks not 1..n, or points out of order."""
    players = [e["player_id"] for e in entries]
    if len(set(players)) != len(players):
        twice = sorted(p for p, n in Counter(players).items() if n > 1)
        return f"shown twice: {twice[:5]}"
    if missing := sorted(known - set(players)):
        return f"missing {len(missing)} acknowledged: {missing[:5]}"
    if [e["rank"] for e in entries] != list(range(1, len(entries) + 1)):
        return "ranks are not 1..n"
    points = [int(e["points"]) for e in entries]
    if points != sorted(points, reverse=True):
        return "points out of order"
    return None


def refused_seconds(attempts: list[chaos.Attempt]) -> float:
    """The seconds during which some write was being refused: the union of the failed attempts'
    spans, each with the client's pause before its retry."""
    spans = sorted((a.start, a.end + chaos.RETRY_PAUSE_S) for a in attempts if a.status != 200)
    total, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return round(total, 2)


async def change(cluster: LocalCluster, phase: str, replicas: int) -> dict[str, Any]:
    """Apply ``phase`` to the cluster; what moved and how long it took."""
    started = time.monotonic()
    if phase == "add":
        port = await asyncio.to_thread(cluster.add_node, replicas)
        moved = await asyncio.to_thread(cluster.rebalance, KEYS_PER_MIGRATE, PAUSE_S)
    else:
        port = cluster.port if cluster.port in cluster.ports else min(cluster.ports)
        moved = await asyncio.to_thread(cluster.remove_node, port, 60.0, KEYS_PER_MIGRATE, PAUSE_S)
    await chaos.healthy(cluster)
    return {
        "node": port,
        "slots_moved": moved.slots,
        "keys_moved": moved.keys,
        "move_s": round(moved.seconds, 2),
        "change_s": round(time.monotonic() - started, 2),
    }


async def scenario(
    router_url: str,
    cluster: LocalCluster,
    phase: str,
    before_s: float,
    after_s: float,
    replicas: int = 0,
    **load: Any,
) -> dict[str, Any]:
    """Write and read for ``before_s``, change the cluster, go on for ``after_s``, settle, compare."""
    return await under_load(
        router_url, phase, lambda _: change(cluster, phase, replicas), before_s, after_s, **load
    )


async def under_load(
    router_url: str,
    phase: str,
    change: Callable[[dict[str, str]], Awaitable[dict[str, Any]]],
    before_s: float,
    after_s: float,
    **load: Any,
) -> dict[str, Any]:
    """Write and read ``phase``'s boards for ``before_s``, make the ``change`` (given the boards:
    name -> mode), go on for ``after_s``, settle, compare: the report of one row of the tables."""
    tag = f"migrate-{phase}-{os.urandom(3).hex()}"
    boards = await chaos.create_boards(router_url, tag)
    writer = chaos.Load(router_url, boards, tag, **load)
    best = next(b for b, mode in boards.items() if mode == "best")
    readers = Readers(router_url, best, writer.ledger)
    running = [asyncio.create_task(writer.run()), asyncio.create_task(readers.run())]
    try:
        await asyncio.sleep(before_s)
        struck = time.monotonic()
        happened = await change(boards)
        await asyncio.sleep(after_s)
    finally:
        writer.stop.set()
        readers.stop.set()
        await asyncio.gather(*running)
    compared = await chaos.compare(router_url, boards, writer.ledger)
    writes = chaos.timeline(writer.attempts, struck)
    report = {
        "phase": phase,
        "boards": sorted(boards),
        **happened,
        "acknowledged": compared["acknowledged"],
        "unsettled_writes": compared["unsettled_writes"],
        "lost": compared["lost"] + compared["best_lost"],
        "duplicates": compared["doubled"] + compared["best_unknown"],
        "write_statuses": writes["statuses"],
        "write_503": writes["statuses"].get("503", 0),
        "refused_s": refused_seconds(writer.attempts),
        "slowest_write_ms": round(max((a.end - a.start for a in writer.attempts), default=0.0) * 1000, 1),
        "reads_checked": readers.checked,
        "reads_inexact": len(readers.inexact),
        "inexact_examples": readers.inexact[:5],
        "read_statuses": dict(sorted(readers.statuses.items())),
        "read_503": readers.statuses.get("503", 0),
    }
    log(
        f"{phase:<12}: {report['acknowledged']} acknowledged, lost {report['lost']}, "
        f"duplicates {report['duplicates']}, reads {report['reads_checked']} checked / "
        f"{report['reads_inexact']} inexact, 503s {report['write_503']} writes + {report['read_503']} reads, "
        f"writes refused {report['refused_s']} s"
    )
    return report


async def run(
    router_url: str, cluster: LocalCluster, before_s: float, replicas: int, **load: Any
) -> list[dict[str, Any]]:
    """Both phases, one after the other, on the same cluster and router."""
    return [await scenario(router_url, cluster, p, before_s, before_s, replicas, **load) for p in PHASES]


def markdown(reports: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| cluster change | acknowledged results | acknowledged but lost | duplicates | reads checked "
        "| reads inexact | 503 (writes / reads) | other errors | seconds writes were refused "
        "| slots / keys moved | move s |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    names = {"add": "add-node (+ replicas) and rebalance", "remove": "remove-node of the first master"}
    for r in reports:
        seen = Counter(r["write_statuses"]) + Counter(r["read_statuses"])
        other = {s: n for s, n in sorted(seen.items()) if s not in ("200", "503")}
        rows.append(
            f"| {names[r['phase']]} ({r['node']}) | {r['acknowledged']:,} | {r['lost']} | {r['duplicates']} "
            f"| {r['reads_checked']} | {r['reads_inexact']} | {r['write_503']} / {r['read_503']} "
            f"| {other or 'none'} | {r['refused_s']} | {r['slots_moved']} / {r['keys_moved']} "
            f"| {r['move_s']} |"
        )
    rows += [
        "",
        "acknowledged but lost: results answered 200 and missing from the board (or below the best "
        "acknowledged); duplicates: incr results counted more often than sent; reads inexact: pages "
        "of the whole board that showed a player twice, missed one acknowledged before the read, or "
        "broke the order; seconds writes were refused: the union of the spans of writes not answered "
        "200 (each retried until it was).",
    ]
    return rows


async def migration(
    out: Path, work: Path, before_s: float, ack: str = "primary", **load: Any
) -> dict[str, Any]:
    """`make chaos`'s migration part on a cluster of its own (3 masters x 1 replica; the master added
    gets a replica too) and a router in ``primary`` mode: both phases' reports."""
    cluster = LocalCluster(3, 1, free_port_block(6, start=22200), work / "migrate-cluster")
    log(f"migration: 3 masters x 1 replica from port {cluster.port}; a master added, then one removed")
    await asyncio.to_thread(cluster.up)
    try:
        port = free_port(22500)
        with Router(cluster.url, port, 1, out / "router-migrate.log", chaos.router_env(ack)) as r:
            reports = await run(r.url, cluster, before_s, 1, **load)
    finally:
        await asyncio.to_thread(cluster.down)
    return {
        "setup": (
            f"3 masters x 1 replica (one more master with a replica added, then the first master "
            f"removed), router in `{ack}` mode, {load.get('tasks', 8)} writers x "
            f"{load.get('batch', 20)} scores per request and {Readers.tasks} readers of whole pages, "
            f"{before_s} s of load before and after each change; slots moved with SETSLOT + MIGRATE, "
            f"{KEYS_PER_MIGRATE} key per MIGRATE and {PAUSE_S * 1000:.0f} ms after each"
        ),
        "phases": reports,
    }


def main() -> None:
    """``python -m bench.migrate``: the migration part of `make chaos` alone."""
    out = run_dir(f"migrate-{time.strftime('%Y%m%d-%H%M%S')}")
    load = {"tasks": env_int("SHARDLB_CHAOS_TASKS", 12), "batch": env_int("SHARDLB_CHAOS_BATCH", 20)}
    with tempfile.TemporaryDirectory(prefix="shardlb-migrate-") as work:
        seconds = env_int("SHARDLB_CHAOS_SECONDS", 6)
        ack = os.environ.get("SHARDLB_ACK", "primary")  # the router's acknowledgement level
        report = asyncio.run(migration(out, Path(work), seconds, ack, **load))
    print(write(out, report, time.strftime("%Y-%m-%d %H:%M:%S")))


def write(out: Path, report: dict[str, Any], when: str) -> str:
    """migrate.md and migrate.json of ``migration``'s report in ``out``; the markdown."""
    text = "\n".join(
        [f"# Slot migration under load ({when})", "", report["setup"], "", *markdown(report["phases"]), ""]
    )
    (out / "migrate.json").write_text(json.dumps({"when": when, **report}, indent=2) + "\n")
    (out / "migrate.md").write_text(text)
    return text


if __name__ == "__main__":
    main()
