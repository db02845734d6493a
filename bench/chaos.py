"""`make chaos`: a failover test that counts every acknowledged score, in the style of Redis's own
cluster consistency test (tests/cluster of the Redis sources, consistency-test.rb).

A client writes through the HTTP API of a router process (``python -m router.server``) and keeps a
ledger of every result the router answered 200. On ``incr`` boards every result adds 1 point, so a
player's value is the number of their results on the board: a result lost and a result counted twice
each show as a difference from the ledger. On ``best`` boards a player's value must be the best
points acknowledged for them. A write not answered 200 is sent again, the same body (match ids and
times included), until it is: a retry is idempotent (api.md), and a game server does just that.

Meanwhile a fault strikes one master of a durable local cluster (``LocalCluster(durable=True)``):

- ``kill``: SIGKILL to the master's redis-server (its pid is in the cluster's state file). Once its
  replica has been promoted (after the cluster's node timeout), the dead node is started again from
  its append-only file, as a supervisor would, and rejoins as the new master's replica. In
  ``replica`` mode the promoted master answers 503 until then: it has no replica to confirm.
- ``kill-lagging``: the same, but the replica is stopped (SIGSTOP) for LAG_S seconds first, while
  writes go on, and resumed right after the kill: it is promoted without what it missed (the
  experiment of issue 11 that found acknowledged results lost; see LAG_S for why it takes seconds).
- ``failover``: CLUSTER FAILOVER on the master's replica (coordinated: the master hands over).

Writing goes on, every write is settled, and the boards are read back (``players:query``) and
compared with the ledger: acknowledged-but-lost, double counted, the 5xx answers, and the seconds
from the fault until writes succeed again for good.

Slot migration (bench/migrate.py): on a cluster of its own, a master is added and slots rebalanced
onto it, then a master is removed, under the same kind of load plus readers that check every page.
Online reshard (bench/reshard.py): on a cluster of its own, with PostgreSQL and the archiver, boards
are resharded through the router's admin endpoint under the same load and readers.

Total loss (``lose_everything``, ``rebuild_all``): once the archiver has caught up, every board's
checksum (shardlb/reconcile.py) is taken, every Redis node is stopped and its files removed, an
empty cluster is started on the same ports, ``shardlb rebuild --all`` restores the boards from
PostgreSQL, and the checksums are taken again.

tests/test_chaos.py runs a short form of the same code in the test suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from bench import durability
from bench.harness import env_int, log, publish, run_dir
from bench.services import Router, free_port
from shardlb import keys, rebuild
from shardlb.cluster import LocalCluster, NodeStatus, free_port_block
from shardlb.reconcile import checksum

ROOT = Path(__file__).resolve().parent.parent
ADMIN_KEY = "chaos-admin-key-00000000"
MODES = ("replica", "primary")
FAULTS = ("kill", "kill-lagging", "failover")
# kill-lagging: how long the replica is stopped before its master is killed. On one machine a
# process killed -9 still has what it wrote to its sockets delivered by the kernel: the replica
# misses only what its master held past the socket buffers (several MB on loopback, a few seconds
# of this load's ~1 MB/s of replication per master). A stop longer than the node timeout (5 s) gets
# the replica marked as failing meanwhile; it is cleared once the replica answers again.
LAG_S = float(os.environ.get("SHARDLB_CHAOS_LAG_SECONDS", "8"))
BOARD_MODES = ("incr", "best")
POINTS_MAX = 2_000_000
RETRY_PAUSE_S = 0.05  # short: the recovery measured is the cluster's, not the client's back-off
HTTP_TIMEOUT_S = 15.0
QUERY_IDS = 1000  # players:query takes at most this many ids
POLL_S = 0.1


@dataclass(frozen=True)
class Write:
    """One request: the same body is sent until it is answered 200."""

    board: str
    mode: str  # the board's mode: "incr" or "best"
    body: dict[str, Any]


@dataclass(frozen=True)
class Attempt:
    start: float  # time.monotonic()
    end: float
    status: int | str  # the HTTP status, or the transport error's class name


@dataclass
class Ledger:
    """What the router acknowledged, per (board, player), and the writes never acknowledged."""

    incr: Counter[tuple[str, str]] = field(default_factory=Counter)
    best: dict[tuple[str, str], int] = field(default_factory=dict)
    unsettled: list[Write] = field(default_factory=list)
    results: int = 0

    def ack(self, write: Write) -> None:
        for s in write.body["scores"]:
            key = (write.board, s["player_id"])
            if write.mode == "incr":
                self.incr[key] += s["points"]
            else:
                self.best[key] = max(self.best.get(key, 0), s["points"])
        self.results += len(write.body["scores"])


@dataclass
class Load:
    """``tasks`` clients writing to ``boards`` (name -> mode) until ``stop`` is set; each has its own
    ``players`` players and sends ``batch`` of them per request. After ``stop`` a write still not
    acknowledged is retried for ``settle_s`` more, then left in the ledger as unsettled."""

    url: str
    boards: dict[str, str]
    tag: str
    tasks: int = 8
    players: int = 50
    batch: int = 20
    settle_s: float = 30.0
    ledger: Ledger = field(default_factory=Ledger)
    attempts: list[Attempt] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        async with client(self.url) as http:
            await asyncio.gather(*(self._task(http, n) for n in range(self.tasks)))

    async def _task(self, http: httpx.AsyncClient, n: int) -> None:
        rng = random.Random(f"{self.tag}-{n}")
        players = [f"{self.tag}-{n}-{i}" for i in range(self.players)]
        names = sorted(self.boards)
        seq = 0
        while not self.stop.is_set():
            board = names[seq % len(names)]
            mode = self.boards[board]
            now = int(time.time() * 1000)  # sent explicitly: a retry must be the same result
            scores = [
                {
                    "player_id": player,
                    "points": 1 if mode == "incr" else rng.randint(1, POINTS_MAX),
                    "match_id": f"{self.tag}-{n}-{seq}",
                    "achieved_at": now,
                }
                for player in rng.sample(players, min(self.batch, len(players)))
            ]
            seq += 1
            await self._settle(http, Write(board, mode, {"scores": scores}))

    async def _settle(self, http: httpx.AsyncClient, write: Write) -> None:
        deadline: float | None = None
        while True:
            start = time.monotonic()
            status: int | str
            try:
                r = await http.post(f"/v1/boards/{write.board}/scores", json=write.body)
                status = r.status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            self.attempts.append(Attempt(start, time.monotonic(), status))
            if status == 200:
                self.ledger.ack(write)
                return
            if isinstance(status, int) and 400 <= status < 500 and status != 429:
                self.ledger.unsettled.append(write)  # refused whole: a retry would be refused again
                return
            if self.stop.is_set():
                deadline = deadline or time.monotonic() + self.settle_s
                if time.monotonic() > deadline:
                    self.ledger.unsettled.append(write)
                    return
            await asyncio.sleep(RETRY_PAUSE_S)


def client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=HTTP_TIMEOUT_S
    )


def router_env(mode: str) -> dict[str, str]:
    """The router's settings for an acknowledgement level (one admin key does everything)."""
    return {"SHARDLB_ACK": mode, "SHARDLB_ADMIN_KEYS": ADMIN_KEY, "SHARDLB_LOG_LEVEL": "warning"}


async def create_boards(url: str, tag: str) -> dict[str, str]:
    """An incr and a best board (16 hash shards: every master holds several, so moving slots moves
    some of them) named after ``tag``."""
    boards = {f"{tag}-{mode}": mode for mode in BOARD_MODES}
    sharding = {"strategy": "hash", "shards": 16}  # named: the API's default is one per master
    async with client(url) as http:
        for name, mode in boards.items():
            body = {"mode": mode, "points_max": POINTS_MAX, "sharding": sharding}
            r = await http.put(f"/v1/boards/{name}", json=body)
            r.raise_for_status()
    return boards


async def board_values(url: str, board: str, players: list[str]) -> dict[str, int]:
    """Each player's points on the board's total, read through the router."""
    values: dict[str, int] = {}
    async with client(url) as http:
        for i in range(0, len(players), QUERY_IDS):
            ids = players[i : i + QUERY_IDS]
            r = await http.post(f"/v1/boards/{board}/players:query", json={"player_ids": ids})
            r.raise_for_status()
            values.update({e["player_id"]: int(e["points"]) for e in r.json()["entries"]})
    return values


async def compare(url: str, boards: dict[str, str], ledger: Ledger) -> dict[str, int]:
    """The boards read back against the ledger. An unsettled write may or may not have been applied:
    its points are allowed on top of the acknowledged ones, never required."""
    maybe_incr: Counter[tuple[str, str]] = Counter()
    maybe_best: dict[tuple[str, str], int] = {}
    for w in ledger.unsettled:
        for s in w.body["scores"]:
            key = (w.board, s["player_id"])
            maybe_incr[key] += s["points"]
            maybe_best[key] = max(maybe_best.get(key, 0), s["points"])
    lost = doubled = best_lost = best_unknown = 0
    for board, mode in boards.items():
        wanted = ledger.incr if mode == "incr" else ledger.best
        players = sorted({p for b, p in (*wanted, *maybe_incr) if b == board})
        values = await board_values(url, board, players)
        for player in players:
            key, got = (board, player), values.get(player, 0)
            if mode == "incr":
                lost += max(0, ledger.incr[key] - got)
                doubled += max(0, got - ledger.incr[key] - maybe_incr[key])
            else:
                best_lost += got < ledger.best.get(key, 0)
                best_unknown += got > max(ledger.best.get(key, 0), maybe_best.get(key, 0))
    return {
        "acknowledged": ledger.results,
        "unsettled_writes": len(ledger.unsettled),
        "lost": lost,  # incr results acknowledged and missing from the board
        "doubled": doubled,  # incr results on the board more often than they were sent
        "best_lost": best_lost,  # best-board players below their best acknowledged points
        "best_unknown": best_unknown,  # best-board players above anything sent for them
    }


def timeline(attempts: list[Attempt], fault_at: float) -> dict[str, Any]:
    """The answers, and the seconds from the fault until writes succeed again for good: until the
    first 200 to a request sent after the last failed one (a stalled request counts while it waits)."""
    statuses = Counter(str(a.status) for a in attempts)
    failed_end = max((a.end for a in attempts if a.status != 200 and a.end >= fault_at), default=fault_at)
    back = min((a.end for a in attempts if a.status == 200 and a.start >= failed_end), default=None)
    after = [a.end - a.start for a in attempts if a.end >= fault_at]
    return {
        "requests": len(attempts),
        "statuses": dict(sorted(statuses.items())),
        "5xx": sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500),
        "transport_errors": sum(n for s, n in statuses.items() if not s.isdigit()),
        "recovery_s": None if back is None else round(back - fault_at, 2),
        "slowest_after_fault_s": round(max(after, default=0.0), 2),
    }


# ---- faults -------------------------------------------------------------------------------------


def node(cluster: LocalCluster, port: int) -> aioredis.Redis:
    return aioredis.Redis(host=cluster.host, port=port, password=cluster.password, socket_timeout=2.0)


def victim(cluster: LocalCluster) -> tuple[NodeStatus, NodeStatus]:
    """A master that has a replica in sync, and that replica (the cluster must be healthy)."""
    status = cluster.status()
    if not status.ok:
        raise RuntimeError(f"cluster not healthy before the fault:\n{status}")
    for master in (n for n in status.nodes if n.role == "master"):
        for replica in status.nodes:
            if replica.role == "replica" and replica.master_port == master.port:
                return master, replica
    raise RuntimeError(f"no master with a replica:\n{status}")


async def promoted(cluster: LocalCluster, port: int, timeout: float = 60.0) -> None:
    """Wait until the node on ``port`` is a master and sees the cluster as ok."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, aioredis.RedisError):
            r = node(cluster, port)
            try:
                role = await r.execute_command("ROLE")
                info = await r.execute_command("CLUSTER INFO")
            finally:
                await r.aclose()
            state = info.get("cluster_state") if isinstance(info, dict) else None  # parsed by redis-py
            if role[0] in (b"master", "master") and state in (b"ok", "ok"):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"node {port} not promoted within {timeout:.0f} s")
        await asyncio.sleep(POLL_S)


async def healthy(cluster: LocalCluster, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not (await asyncio.to_thread(cluster.status)).ok:
        if time.monotonic() > deadline:
            raise RuntimeError(f"cluster not healthy within {timeout:.0f} s:\n{cluster.status()}")
        await asyncio.sleep(POLL_S)


async def strike(cluster: LocalCluster, fault: str) -> tuple[float, dict[str, Any]]:
    """Apply ``fault`` (one of FAULTS) to one master; return when it struck, and once the
    replica is promoted and the cluster healthy again, what happened when."""
    master, replica = await asyncio.to_thread(victim, cluster)
    struck = time.monotonic()
    if fault == "failover":
        r = node(cluster, replica.port)
        try:
            await r.execute_command("CLUSTER FAILOVER")
        finally:
            await r.aclose()
    else:
        assert master.pid is not None and replica.pid is not None
        if fault == "kill-lagging":
            os.kill(replica.pid, signal.SIGSTOP)
        try:
            if fault == "kill-lagging":
                await asyncio.sleep(LAG_S)  # writes go on; the stopped replica falls behind
            os.kill(master.pid, signal.SIGKILL)
        finally:
            if fault == "kill-lagging":
                os.kill(replica.pid, signal.SIGCONT)
    await promoted(cluster, replica.port)
    promoted_s = time.monotonic() - struck
    if fault != "failover":
        # The dead node starts again from its files and rejoins as the new master's replica.
        await asyncio.to_thread(cluster.up)
    await healthy(cluster)
    return struck, {
        "master": master.port,
        "replica": replica.port,
        "promoted_s": round(promoted_s, 2),
        "healthy_s": round(time.monotonic() - struck, 2),
    }


@dataclass
class Scenario:
    """One run of the load through one fault: its boards, its ledger and what it measured."""

    mode: str
    fault: str
    boards: dict[str, str]
    ledger: Ledger
    report: dict[str, Any]


async def scenario(
    router_url: str,
    cluster: LocalCluster,
    mode: str,
    fault: str,
    before_s: float,
    after_s: float,
    **load: Any,
) -> Scenario:
    """Write for ``before_s``, strike, keep writing ``after_s`` past the recovery, settle, compare.
    ``mode`` is the router's acknowledgement level (the caller started the router with it)."""
    tag = f"chaos-{mode}-{fault}-{os.urandom(3).hex()}"
    boards = await create_boards(router_url, tag)
    writer = Load(router_url, boards, tag, **load)
    running = asyncio.create_task(writer.run())
    try:
        await asyncio.sleep(before_s)
        struck, happened = await strike(cluster, fault)
        await asyncio.sleep(after_s)
    finally:
        writer.stop.set()
        await running
    report = {
        "mode": mode,
        "fault": fault,
        **happened,
        **timeline(writer.attempts, struck),
        **await compare(router_url, boards, writer.ledger),
    }
    log(
        f"{mode:<7} {fault:<12}: {report['acknowledged']} acknowledged, lost {report['lost']}, "
        f"doubled {report['doubled']}, best lost {report['best_lost']}, 5xx {report['5xx']}, "
        f"errors {report['transport_errors']}, promoted after {report['promoted_s']} s, "
        f"writes back after {report['recovery_s']} s"
    )
    return Scenario(mode, fault, boards, writer.ledger, report)


# ---- total loss ---------------------------------------------------------------------------------


async def wait_archived(redis_url: str, boards: list[str], timeout: float = 120.0) -> None:
    """Wait until the archiver has every journal entry of ``boards`` in PostgreSQL."""
    deadline = time.monotonic() + timeout
    for board in boards:
        while (await asyncio.to_thread(durability.journals, redis_url, board))["lag_entries"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the archiver has not caught up with {board} in {timeout:.0f} s")
            await asyncio.sleep(0.5)


async def checksums(redis_url: str, postgres_url: str, boards: list[str]) -> dict[str, list[int]]:
    """Each board's [players, checksum] over every shard's total (shardlb/reconcile.py's checksum)."""
    out: dict[str, list[int]] = {}
    async with rebuild.connected(redis_url, postgres_url) as (rebuilder, store):
        for name in boards:
            board = await store.get(name)
            members: dict[str, int] = {}
            for prefix in board.prefixes:
                members.update(await rebuilder.members(keys.period_key(prefix, "total")))
            out[name] = [len(members), checksum(members)]
    return out


def lose_everything(cluster: LocalCluster) -> None:
    """Stop every node, remove their files (data, append-only files, nodes.conf) and start an empty
    cluster of the same layout on the same ports."""
    cluster.down()
    for node_dir in cluster.dir.glob("node-*"):
        shutil.rmtree(node_dir)
    cluster.up()


def rebuild_all(redis_url: str, postgres_url: str, log_path: Path) -> float:
    """``shardlb rebuild --all`` as an operator runs it; the seconds it took."""
    start = time.monotonic()
    with open(log_path, "ab") as out:
        subprocess.run(
            [sys.executable, "-m", "shardlb", "rebuild", "--all", "--redis", redis_url,
             "--postgres", postgres_url],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=600,
        )  # fmt: skip
    return time.monotonic() - start


# ---- make chaos ---------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    rows = [
        "| ack mode | fault | acknowledged results | lost | double counted | best below acked | 5xx "
        "| transport errors | promoted after s | writes succeed again after s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report["scenarios"]:
        rows.append(
            f"| {s['mode']} | {s['fault']} | {s['acknowledged']:,} | {s['lost']} | {s['doubled']} "
            f"| {s['best_lost']} | {s['5xx']} | {s['transport_errors']} | {s['promoted_s']} "
            f"| {s['recovery_s']} |"
        )
    loss = report["total_loss"]
    equal, lost = loss["equal_by_mode"], loss["lost_after"]
    rows += [
        "",
        "| total loss of Redis | boards | checksums equal to before (replica / primary boards) "
        "| `rebuild --all` s | lost acknowledged after the rebuild (replica / primary) |",
        "|---|---:|---:|---:|---:|",
        f"| every node stopped, its files removed, an empty cluster rebuilt from PostgreSQL "
        f"| {loss['boards']} | {equal['replica']} / {equal['primary']} | {loss['rebuild_s']} "
        f"| {lost['replica']} / {lost['primary']} |",
    ]
    if "migration" in report:
        from bench import migrate

        rows += ["", "Slot migration under load: " + report["migration"]["setup"], ""]
        rows += migrate.markdown(report["migration"]["phases"])
    if "reshard" in report:
        from bench import reshard

        rows += ["", "Online reshard under load: " + report["reshard"]["setup"], ""]
        rows += reshard.markdown(report["reshard"]["steps"])
    return "\n".join(
        [
            f"# Chaos ({report['when']})",
            "",
            f"{report['setup']}",
            "",
            *rows,
            "",
            "lost: incr results answered 200 and missing from the board; double counted: incr results on "
            "the board more often than sent; best below acked: players whose best board shows less than "
            "their best acknowledged points. Every write not answered 200 was retried until it was.",
            "",
        ]
    )


async def chaos(out: Path, work: Path) -> dict[str, Any]:
    before_s = env_int("SHARDLB_CHAOS_SECONDS", 6)
    load = {"tasks": env_int("SHARDLB_CHAOS_TASKS", 12), "batch": env_int("SHARDLB_CHAOS_BATCH", 20)}
    cluster = LocalCluster(3, 1, free_port_block(6, start=22100), work / "cluster", durable=True)
    db = durability.ArchiveDatabase(work / "postgres")
    archiver: durability.ArchiverProcess | None = None
    log(f"cluster: 3 masters x 1 replica, durable, from port {cluster.port}; results in {out}")
    await asyncio.to_thread(cluster.up)
    try:
        db.up()
        archiver = durability.ArchiverProcess(cluster.url, db.url, out / "archiver.log").start()
        scenarios: list[Scenario] = []
        for mode in MODES:
            with Router(cluster.url, free_port(22400), 1, out / f"router-{mode}.log", router_env(mode)) as r:
                for fault in FAULTS:
                    scenarios.append(await scenario(r.url, cluster, mode, fault, before_s, before_s, **load))
        loss = await total_loss(cluster, db.url, archiver, scenarios, out)
    finally:
        if archiver is not None:
            archiver.stop()
        db.down()
        cluster.down()
    from bench import migrate  # it builds on this module

    moved = await migrate.migration(out, work, before_s, **load)
    from bench import reshard

    resharded = await reshard.resharding(out, work, before_s, **load)
    return {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "setup": (
            f"3 masters x 1 replica (durable, cluster-node-timeout 5000 ms), one router process per "
            f"acknowledgement level (SHARDLB_ACK_TIMEOUT_MS 500), {load['tasks']} clients x "
            f"{load['batch']} scores per request, {before_s} s of writes before the fault and "
            f"{before_s} s after the cluster is healthy again; archiver `shardlb archive` into "
            f"{db.describe()}; {os.cpu_count()} cores shared with other work"
        ),
        "scenarios": [s.report for s in scenarios],
        "total_loss": loss,
        "migration": moved,
        "reshard": resharded,
    }


async def total_loss(
    cluster: LocalCluster,
    postgres_url: str,
    archiver: durability.ArchiverProcess,
    scenarios: list[Scenario],
    out: Path,
    router_port: int = 22400,
) -> dict[str, Any]:
    """Every scenario's boards after a total loss of Redis and `rebuild --all`: checksums before and
    after, and the ledgers read back again through a new router (on the first free port from
    ``router_port``: the tests pass one of their own, tests/ports.py)."""
    names = [b for s in scenarios for b in s.boards]
    log("waiting for the archiver to catch up")
    await wait_archived(cluster.url, names)
    before = await checksums(cluster.url, postgres_url, names)
    archiver.stop()
    log("total loss: every node stopped and emptied; rebuilding from PostgreSQL")
    await asyncio.to_thread(lose_everything, cluster)
    rebuild_s = await asyncio.to_thread(rebuild_all, cluster.url, postgres_url, out / "rebuild.log")
    after = await checksums(cluster.url, postgres_url, names)
    lost_after = dict.fromkeys(MODES, 0)
    with Router(cluster.url, free_port(router_port), 1, out / "router-after.log", router_env("primary")) as r:
        for s in scenarios:
            counts = await compare(r.url, s.boards, s.ledger)
            lost_after[s.mode] += counts["lost"] + counts["best_lost"]
    equal = sum(before[b] == after[b] for b in names)
    log(
        f"rebuild --all: {equal} of {len(names)} boards equal to before, {rebuild_s:.1f} s; lost {lost_after}"
    )
    return {
        "boards": len(names),
        "equal": equal,
        "equal_by_mode": {m: sum(before[b] == after[b] for s in scenarios if s.mode == m for b in s.boards)
                          for m in MODES},
        "rebuild_s": round(rebuild_s, 1),
        "lost_after": lost_after,
        "checksums": {b: {"before": before[b], "after": after[b]} for b in names},
    }  # fmt: skip


def main() -> None:
    out = run_dir(f"chaos-{time.strftime('%Y%m%d-%H%M%S')}")
    with tempfile.TemporaryDirectory(prefix="shardlb-chaos-") as work:
        report = asyncio.run(chaos(out, Path(work)))
    (out / "chaos.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "chaos.md").write_text(markdown(report))
    from bench import migrate

    migrate.write(out, report["migration"], report["when"])
    from bench import reshard

    reshard.write(out, report["reshard"], report["when"])
    publish(out, ["chaos.md", "chaos.json", "migrate.md", "migrate.json", "reshard.md", "reshard.json"])
    print(markdown(report))


if __name__ == "__main__":
    main()
