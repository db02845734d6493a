"""Online reshard under load (issue 15, items 2-3): `make chaos`'s reshard table, and the code that
tests/test_reshard_http.py runs in short form.

As in bench/migrate.py, clients write through a router's HTTP API and keep a ledger of every
acknowledged result, and readers page through the ``best`` board checking every page. Meanwhile
both boards (incr and best, journaled, archived into PostgreSQL by `shardlb archive`) are
resharded through the router's admin endpoint (``POST /v1/admin/boards/{board}/reshard``): 16 ->
4 shards, then (on new boards) 16 -> 40, then (on new boards) to a band board of 4 home shards and
2 bands and at once to one of 3 home shards and 4 other bands (``STEPS``). Afterwards the boards
are compared with the ledger, and Redis with PostgreSQL (`shardlb reconcile`'s check: the
archive's rows re-homed to the new shards).

``python -m bench.reshard`` (`make bench-reshard`; SHARDLB_RESHARD_PLAYERS, default 1,000,000)
measures the reshard of a board of that many players while writers post results over HTTP;
``python -m bench.reshard table`` makes the chaos table alone.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import chaos, durability, migrate, population
from bench.harness import env_int, log, publish, run_dir
from bench.services import Router, free_port
from bench.workload import Workload
from shardlb import rebuild, reconcile
from shardlb.cluster import LocalCluster, free_port_block
from shardlb.postgres import LocalPostgres

# The chaos boards have 16 hash shards. Each step reshards new boards through these layouts in turn,
# (shards, band starts or None): fewer shards, more shards, and a band board given new band starts
# (home shards and bands both change; the incr board's totals fall in the low bands, the best
# board's points, up to POINTS_MAX, spread over them all).
Layout = tuple[int, "list[int] | None"]
STEPS: tuple[tuple[str, tuple[Layout, ...]], ...] = (
    ("down", ((4, None),)),
    ("up", ((40, None),)),
    ("bands", ((4, [0, 1_000_000]), (3, [0, 10, 700_000, 1_400_000]))),
)


def layouts_text(layouts: tuple[Layout, ...]) -> str:
    """``16 -> 4 shards``, or ``16 -> band 4 + 2 -> band 3 + 4`` (home shards + bands)."""
    names = [f"band {s} + {len(b)}" if b else f"{s} shards" for s, b in layouts]
    return " -> ".join(["16", *names])


POLL_S = 0.2


async def reshard_boards(
    router_url: str, boards: list[str], shards: int, timeout_s: float = 600.0, bands: list[int] | None = None
) -> dict[str, Any]:
    """Reshard every board to ``shards`` (with ``bands``: a band board of ``shards`` home shards and
    those bands) through the admin endpoint and wait until each is done; what the routers' status
    said on the way."""
    started = time.monotonic()
    states: dict[str, set[str]] = {b: set() for b in boards}
    cutover: dict[str, float] = {}
    body: dict[str, Any] = {"shards": shards, **({"bands": bands} if bands else {})}
    async with chaos.client(router_url) as http:
        for board in boards:
            r = await http.post(f"/v1/admin/boards/{board}/reshard", json=body)
            if r.status_code != 202:
                raise RuntimeError(f"reshard of {board} refused: {r.status_code} {r.text}")
        left = set(boards)
        while left:
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"reshards not done after {timeout_s} s: {sorted(left)}")
            await asyncio.sleep(POLL_S)
            for board in sorted(left):
                status = (await http.get(f"/v1/admin/boards/{board}/reshard")).json()
                if status["state"] not in states[board]:
                    log(f"{board}: {status['state']} ({status})")
                states[board].add(status["state"])
                if status.get("writes_refused_ms") is not None:
                    cutover[board] = status["writes_refused_ms"]
                if status["state"] == "none" and status["shards"] == shards:
                    left.discard(board)
                    last = status.get("last") or {}
                    if last.get("writes_refused_ms") is not None:
                        cutover[board] = last["writes_refused_ms"]
    return {
        "shards": shards,
        "reshard_s": round(time.monotonic() - started, 2),
        "cutover_ms": max(cutover.values(), default=None),
        "states_seen": sorted(set().union(*states.values())),
    }


async def drift(redis_url: str, postgres_url: str, boards: list[str]) -> int:
    """Shards of ``boards`` whose players or sums differ between Redis and PostgreSQL."""
    await chaos.wait_archived(redis_url, boards)
    found = 0
    async with rebuild.connected(redis_url, postgres_url) as (rebuilder, store):
        for board in boards:
            checks = await reconcile.reconcile(rebuilder, await store.get(board))
            found += sum(c.drift for c in checks)
    return found


async def resharding(out: Path, work: Path, before_s: float, **load: Any) -> dict[str, Any]:
    """`make chaos`'s reshard part on a cluster of its own (3 masters x 1 replica), with PostgreSQL,
    the archiver and a router in ``primary`` mode: one report per step."""
    cluster = LocalCluster(3, 1, free_port_block(6, start=22600), work / "reshard-cluster")
    db = LocalPostgres(work / "reshard-postgres", fast=True)
    log(f"reshard: 3 masters x 1 replica from port {cluster.port}; boards of 16 shards resharded")
    await asyncio.to_thread(cluster.up)
    try:
        db.up()
        reports = await with_router(out, cluster.url, db.url, before_s, 22700, **load)
    finally:
        db.down()
        await asyncio.to_thread(cluster.down)
    return {
        "setup": (
            f"3 masters x 1 replica, PostgreSQL and `shardlb archive`, a router in `primary` mode; an incr "
            f"and a best board (journaled, 16 hash shards; new boards each step, the last step's made "
            f"band boards and then given new band starts) resharded through the admin endpoint while "
            f"{load.get('tasks', 8)} writers x {load.get('batch', 20)} scores per request and "
            f"{migrate.Readers.tasks} readers of whole pages ran, {before_s} s of load before and after"
        ),
        "steps": reports,
    }


async def with_router(
    out: Path, redis_url: str, postgres_url: str, before_s: float, port: int, **load: Any
) -> list[dict[str, Any]]:
    """Every step of STEPS through one router process (with the archive) and an archiver."""
    archiver = durability.ArchiverProcess(redis_url, postgres_url, out / "archiver-reshard.log").start()
    try:
        env = {**chaos.router_env("primary"), "SHARDLB_POSTGRES_URL": postgres_url}
        with Router(redis_url, free_port(port), 1, out / "router-reshard.log", env) as r:
            return [
                await step(r.url, redis_url, postgres_url, name, layouts, before_s, **load)
                for name, layouts in STEPS
            ]
    finally:
        archiver.stop()


async def step(
    router_url: str,
    redis_url: str,
    postgres_url: str,
    name: str,
    layouts: tuple[Layout, ...],
    before_s: float,
    **load: Any,
) -> dict[str, Any]:
    """New boards under load, resharded through ``layouts`` one after the other; the report, with
    the drift from PostgreSQL."""

    async def change(boards: dict[str, str]) -> dict[str, Any]:
        done = [await reshard_boards(router_url, sorted(boards), s, bands=b) for s, b in layouts]
        cutovers = [d["cutover_ms"] for d in done if d["cutover_ms"] is not None]
        return {
            "shards": done[-1]["shards"],
            "bands": layouts[-1][1],
            "layouts": layouts_text(layouts),
            "reshard_s": round(sum(d["reshard_s"] for d in done), 2),
            "cutover_ms": max(cutovers, default=None),
            "states_seen": sorted({state for d in done for state in d["states_seen"]}),
        }

    report = await migrate.under_load(router_url, f"reshard-{name}", change, before_s, before_s, **load)
    report["drifting_shards"] = await drift(redis_url, postgres_url, report["boards"])
    return report


def markdown(reports: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| reshard | acknowledged results | acknowledged but lost | duplicates | reads checked "
        "| reads inexact | 503 (writes / reads) | seconds writes were refused | cut-over pause (ms) "
        "| slowest write (ms) | reshard s | shards drifting from PostgreSQL |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in reports:
        layouts = r.get("layouts") or f"16 -> {r['shards']} shards"  # reports of before the band step
        rows.append(
            f"| {layouts} | {r['acknowledged']:,} | {r['lost']} | {r['duplicates']} "
            f"| {r['reads_checked']} | {r['reads_inexact']} | {r['write_503']} / {r['read_503']} "
            f"| {r['refused_s']} | {r['cutover_ms']} | {r['slowest_write_ms']} | {r['reshard_s']} "
            f"| {r['drifting_shards']} |"
        )
    rows += [
        "",
        "Columns as in the migration table; cut-over pause: from the mover's first seal to the new "
        "layout's opening (the router holds writes to the board meanwhile and makes them again; past 2 s "
        "they would be answered 503 `board_resharding`); slowest write: the longest HTTP write of the run; "
        "shards drifting: `shardlb reconcile`'s check of every new shard against PostgreSQL after the "
        "archiver drained the old layout's journals.",
    ]
    return rows


def write(out: Path, report: dict[str, Any], when: str) -> str:
    text = "\n".join(
        [f"# Online reshard under load ({when})", "", report["setup"], "", *markdown(report["steps"]), ""]
    )
    (out / "reshard.json").write_text(json.dumps({"when": when, **report}, indent=2) + "\n")
    (out / "reshard.md").write_text(text)
    return text


# ---- a big board resharded while the bench's writers run --------------------------------------


async def big(out: Path, work: Path, players: int, shards: tuple[int, int]) -> dict[str, Any]:
    """A ``players`` board of ``shards[0]`` shards (memory: no archive to wait for) resharded to
    ``shards[1]`` through the admin endpoint while writers post results over HTTP."""
    cluster = LocalCluster(3, 0, free_port_block(3, start=22800), work / "reshard-big")
    await asyncio.to_thread(cluster.up)
    try:
        env = {**chaos.router_env("primary")}
        with Router(cluster.url, free_port(22900), 1, out / "router-reshard-big.log", env) as r:
            board = "reshard-big"
            async with chaos.client(r.url) as http:
                body = {"durability": "memory", "points_max": chaos.POINTS_MAX,
                        "sharding": {"strategy": "hash", "shards": shards[0]}}  # fmt: skip
                (await http.put(f"/v1/boards/{board}", json=body)).raise_for_status()
            started = time.monotonic()
            workload = Workload(board=board, players=players)
            await asyncio.to_thread(population.load_parallel, cluster.url, workload, 0, players, 2)
            loaded_s = time.monotonic() - started
            log(f"reshard-big: {players:,} players loaded in {loaded_s:.1f} s")
            writer = chaos.Load(r.url, {board: "best"}, "big", tasks=8, players=2000, batch=20)
            running = asyncio.create_task(writer.run())
            try:
                await asyncio.sleep(2.0)
                done = await reshard_boards(r.url, [board], shards[1], timeout_s=1800.0)
                await asyncio.sleep(2.0)
            finally:
                writer.stop.set()
                await running
            compared = await chaos.compare(r.url, {board: "best"}, writer.ledger)
            async with chaos.client(r.url) as http:
                size = (await http.get(f"/v1/boards/{board}")).json()["players"]["total"]
            written = {p for (b, p) in writer.ledger.best if b == board}
    finally:
        await asyncio.to_thread(cluster.down)
    return {
        "players": players,
        "from_shards": shards[0],
        **done,
        "acknowledged": compared["acknowledged"],
        "lost": compared["lost"] + compared["best_lost"],
        "refused_s": migrate.refused_seconds(writer.attempts),
        "players_after": size,
        "players_expected": players + len(written),  # the loaded ones and the writers' own
        "writes_per_s": round(compared["acknowledged"] / max(done["reshard_s"] + 4.0, 1e-9)),
    }


def main() -> None:
    out = run_dir(f"reshard-{time.strftime('%Y%m%d-%H%M%S')}")
    if sys.argv[1:] == ["table"]:  # `make chaos`'s reshard table alone
        with tempfile.TemporaryDirectory(prefix="shardlb-reshard-") as work:
            load = {"tasks": env_int("SHARDLB_CHAOS_TASKS", 12), "batch": env_int("SHARDLB_CHAOS_BATCH", 20)}
            found = asyncio.run(resharding(out, Path(work), env_int("SHARDLB_CHAOS_SECONDS", 6), **load))
        print(write(out, found, time.strftime("%Y-%m-%d %H:%M:%S")))
        publish(out, ["reshard.md", "reshard.json"])
        return
    players = env_int("SHARDLB_RESHARD_PLAYERS", 1_000_000)
    with tempfile.TemporaryDirectory(prefix="shardlb-reshard-") as work:
        report = asyncio.run(big(out, Path(work), players, (16, 4)))
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    (out / "reshard-big.json").write_text(json.dumps({"when": when, **report}, indent=2) + "\n")
    log(
        f"reshard of {players:,} players, 16 -> 4 shards under writers: {report['reshard_s']} s, "
        f"cut-over pause {report['cutover_ms']} ms, {report['acknowledged']:,} acknowledged, "
        f"lost {report['lost']}, writes refused {report['refused_s']} s, players after "
        f"{report['players_after']:,} (expected {report['players_expected']:,})"
    )
    publish(out, ["reshard-big.json"])


if __name__ == "__main__":
    main()
