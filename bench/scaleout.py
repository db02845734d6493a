"""`make bench-scaleout`: writes/s and "my rank" reads/s of the raw library on clusters of 1, 2 and 3
masters, then "my rank" reads from replicas on clusters of 3 masters with 1 and 2 replicas each,
every node pinned to a CPU, with what every operation cost each node in Redis CPU.

    SHARDLB_SCALEOUT_PLAYERS=200000 SHARDLB_SCALEOUT_SECONDS=8 python -m bench.scaleout

For each master count in SHARDLB_SCALEOUT_MASTERS (1,2,3) a private cluster starts (no replicas,
node ports from 22300, below 22768), every thread of each redis-server is pinned to one CPU with
`taskset -a -cp`, round robin over the CPUs this process may use, and the load generator (this
process: one asyncio loop, ``sched_setaffinity``) to the CPU that holds the fewest masters
(``placement``). A hash board of one shard per master (the planner's layout;
SHARDLB_SCALEOUT_SHARDS_PER_MASTER) is preloaded with SHARDLB_SCALEOUT_PLAYERS players
(bench/population.py), then, after a second of warm-up each (``Settings.warmup``; and with
SHARDLB_SCALEOUT_QUIET_WAIT, a wait of up to that many seconds for other load on the machine to
drop, as `make bench` can), for SHARDLB_SCALEOUT_SECONDS:

- writes: batches of SHARDLB_SCALEOUT_BATCH_MATCHES matches, grouped by shard, one script call per
  shard (bench/raw.py), SHARDLB_SCALEOUT_WRITE_TASKS batches in flight;
- reads: ``Board.player`` of random players ("my rank", exact: it counts on every shard),
  SHARDLB_SCALEOUT_READ_TASKS at a time.

Per phase: operations a second; each master's CPU microseconds per operation, from INFO cpu
(used_cpu_user + used_cpu_sys) before and after; the load generator's own CPU per operation; each
CPU's busy share and the cores other processes took, from /proc/stat. A write costs the one master
of its shard, an exact read costs every master, so the per-master costs say what more masters
buy even where the throughput cannot: ``ceiling`` is the rate at which the busiest master would fill
one core of its own at these costs. On two cores the masters and the load generator share the
cores (from two masters on), so the throughput shows the cores, and the ceilings are a model.

Then, for each R in SHARDLB_SCALEOUT_REPLICAS (1,2), a cluster of SHARDLB_SCALEOUT_REPLICA_MASTERS
(3) masters with R replicas each (every node pinned, round robin in port order; the load generator
beside the fewest replicas), the same board and preload, a wait until every replica has applied the
preload, then the same "my rank" reads twice through one READONLY client
(``connect(url, read_from="replicas")``): from a board that reads the primaries, then from one whose
reads go to the replicas (``BoardStore.read_replicas``, as the router's SHARDLB_READ_FROM). Per
phase, besides the figures above, each replica's CPU per read, the busiest replica's ceiling and each
replica's share of its master's replicas' CPU: each replica carries about 1/R of its group's reads,
so the reads that fit grow with R. Replicas answer with what they have received: they lag their
primary by the replication lag (router/README.md, "Reads from replicas").

Results: bench/results/scaleout-<timestamp>/scaleout.{json,md}, copied to bench/results/latest/.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import redis
from redis.asyncio.cluster import RedisCluster

from bench import population, raw
from bench.harness import env_int, env_ints, log, publish, run_dir
from bench.hot import band_sharding
from bench.latency import Phase, elapsed_ms, run_phase
from bench.run import wait_for_quiet
from bench.testbed import create_board, machine, node_pids, start_cluster
from bench.workload import Workload
from shardlb.board import Board
from shardlb.cluster import LocalCluster, master_slots
from shardlb.connection import Scripts, connect
from shardlb.keys import slot_of
from shardlb.store import BoardStore

FIRST_PORT = 22300  # clear of make bench's 22100+ and its sweep's 22200+
WARMUP_S = 1.0
# The band board's "my rank" with max_age_ms: the other bands' sizes up to this old (Board.player).
KEPT_AGE_MS = 1000
POLLED_PLAYERS = 1000  # hash board: "my rank" of this many players, each read several times a second
CATCH_UP_S = 60.0  # the longest wait for the replicas to apply the preload
FILES = ("scaleout.json", "scaleout.md")


@dataclass(frozen=True)
class Settings:
    """The run's knobs, from SHARDLB_SCALEOUT_* variables (``from_env``)."""

    masters: tuple[int, ...] = (1, 2, 3)
    players: int = 200_000
    seconds: float = 8  # of each timed phase (fractions too: tests/test_bench_scaleout.py's tiny run)
    write_tasks: int = 4
    read_tasks: int = 16
    batch_matches: int = 100
    shards_per_master: int = 1
    quiet_wait: int = 0  # seconds to wait, before each cluster's phases, for other load to drop
    replica_masters: int = 3  # the masters of the replicas sweep's clusters
    replicas: tuple[int, ...] = (1, 2)  # replicas per master, one cluster each (empty: no sweep)
    band: bool = True  # a band board's writes and reads on each cluster of the masters sweep too
    pool_matches: int = raw.POOL_MATCHES  # matches drawn before each write phase (the tiny run's are fewer)
    warmup: float = WARMUP_S  # seconds of the untimed warm-up before each phase (the tiny run's is shorter)

    @classmethod
    def from_env(cls) -> Settings:
        d = cls()
        return cls(
            tuple(env_ints("SHARDLB_SCALEOUT_MASTERS", ",".join(map(str, d.masters)))),
            env_int("SHARDLB_SCALEOUT_PLAYERS", d.players),
            env_int("SHARDLB_SCALEOUT_SECONDS", d.seconds),
            env_int("SHARDLB_SCALEOUT_WRITE_TASKS", d.write_tasks),
            env_int("SHARDLB_SCALEOUT_READ_TASKS", d.read_tasks),
            env_int("SHARDLB_SCALEOUT_BATCH_MATCHES", d.batch_matches),
            env_int("SHARDLB_SCALEOUT_SHARDS_PER_MASTER", d.shards_per_master),
            env_int("SHARDLB_SCALEOUT_QUIET_WAIT", d.quiet_wait),
            env_int("SHARDLB_SCALEOUT_REPLICA_MASTERS", d.replica_masters),
            tuple(env_ints("SHARDLB_SCALEOUT_REPLICAS", ",".join(map(str, d.replicas)))),
            os.environ.get("SHARDLB_SCALEOUT_BAND", "1") != "0",
        )


@dataclass(frozen=True)
class Placement:
    """The CPU of each master and each replica (in port order) and of the load generator."""

    masters: tuple[int, ...]
    driver: int
    replicas: tuple[int, ...] = ()

    def shared(self) -> bool:
        """Whether any CPU runs more than one of them."""
        cpus = [*self.masters, *self.replicas, self.driver]
        return len(set(cpus)) < len(cpus)


def placement(masters: int, cpus: Sequence[int], replicas: int = 0) -> Placement:
    """Every node round robin over ``cpus`` in port order (the masters, then ``replicas`` per
    master); the load generator on the CPU holding the fewest of the nodes that serve the reads
    (the replicas when there are any, else the masters; the last such CPU), so it shares a core
    with one only when every core already runs one."""
    if masters < 1 or replicas < 0 or not cpus:
        raise ValueError(
            f"need a master and a CPU, got {masters} masters, {replicas} replicas on {list(cpus)}"
        )
    ordered = sorted(cpus)
    on = [ordered[i % len(ordered)] for i in range(masters * (1 + replicas))]
    serving = on[masters:] if replicas else on
    driver = min(reversed(ordered), key=serving.count)
    return Placement(tuple(on[:masters]), driver, tuple(on[masters:]))


def pin(pid: int, cpu: int) -> list[int]:
    """Pin every thread of process ``pid`` to ``cpu``; the affinity it then has."""
    subprocess.run(["taskset", "-a", "-cp", str(cpu), str(pid)], check=True, capture_output=True)
    return sorted(os.sched_getaffinity(pid))


@contextlib.contextmanager
def pinned(cpu: int) -> Iterator[None]:
    """This process on ``cpu`` for the block, then back where it may run."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def cpu_ticks(stat: str) -> dict[int, tuple[int, int, int]]:
    """(busy, steal, total) clock ticks of each CPU from the text of /proc/stat. Busy is user, nice,
    system, irq and softirq; steal is what the hypervisor gave to other guests."""
    out = {}
    for line in stat.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[:8])
            busy = user + nice + system + irq + softirq
            out[int(name[3:])] = (busy, steal, busy + steal + idle + iowait)
    return out


def busy_shares(
    before: dict[int, tuple[int, int, int]], after: dict[int, tuple[int, int, int]]
) -> dict[int, float]:
    """Each CPU's busy share between two ``cpu_ticks`` readings."""
    out = {}
    for cpu, (busy, _, total) in after.items():
        b0, _, t0 = before.get(cpu, (0, 0, 0))
        out[cpu] = round((busy - b0) / (total - t0), 2) if total > t0 else 0.0
    return out


def figures(
    ops: int, seconds: float, master_cpu_s: Sequence[float], driver_cpu_s: float, busy_cpu_s: float
) -> dict[str, Any]:
    """A phase's figures from its counts: rate, Redis CPU per operation on each master and in all,
    the ``ceiling`` (operations a second at which the busiest master would use one whole core), the
    load generator's CPU per operation, and the cores that other processes took (``busy_cpu_s``:
    every CPU's busy seconds in the phase)."""
    if not ops or seconds <= 0:
        return {"ops": ops, "ops_per_s": 0.0}
    per_master = [s / ops * 1e6 for s in master_cpu_s]
    busiest = max(per_master)
    return {
        "ops": ops,
        "seconds": round(seconds, 2),
        "ops_per_s": round(ops / seconds, 1),
        "redis_us_per_op": [round(us, 2) for us in per_master],
        "redis_us_per_op_all": round(sum(per_master), 2),
        "ceiling_per_s": round(1e6 / busiest) if busiest > 0 else None,
        "master_cores": [round(s / seconds, 2) for s in master_cpu_s],
        "driver_us_per_op": round(driver_cpu_s / ops * 1e6, 2),
        "driver_cores": round(driver_cpu_s / seconds, 2),
        "other_cores": round(max(0.0, busy_cpu_s - sum(master_cpu_s) - driver_cpu_s) / seconds, 2),
    }


def replica_figures(
    ops: int, seconds: float, replica_cpu_s: Sequence[float], groups: Sequence[int]
) -> dict[str, Any]:
    """The replicas' part of a phase's figures: Redis CPU per operation on each replica, in all and
    on the busiest; ``replica_ceiling_per_s``, the operations a second at which the busiest replica
    would use one whole core; and each replica's ``replica_shares``, its part of the CPU that its
    master's replicas spent (``groups``: each replica's master): 1/R when R replicas share the reads
    evenly. Empty without replicas or operations."""
    if not ops or seconds <= 0 or not replica_cpu_s:
        return {}
    per_replica = [s / ops * 1e6 for s in replica_cpu_s]
    busiest = max(per_replica)
    group_s: dict[int, float] = {}
    for group, s in zip(groups, replica_cpu_s, strict=True):
        group_s[group] = group_s.get(group, 0.0) + s
    return {
        "replica_us_per_op": [round(us, 2) for us in per_replica],
        "replica_us_per_op_all": round(sum(per_replica), 2),
        "replica_us_per_op_busiest": round(busiest, 2),
        "replica_ceiling_per_s": round(1e6 / busiest) if busiest > 0 else None,
        "replica_cores": [round(s / seconds, 2) for s in replica_cpu_s],
        "replica_shares": [
            round(s / group_s[g], 2) if group_s[g] > 0 else 0.0
            for g, s in zip(groups, replica_cpu_s, strict=True)
        ],
    }


def redis_cpu_s(node: redis.Redis) -> float:
    info = node.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def used_memory(node: redis.Redis) -> int:
    return int(node.info("memory")["used_memory"])


def read_stat() -> dict[int, tuple[int, int, int]]:
    return cpu_ticks(Path("/proc/stat").read_text())


def shards_on_masters(board: Board, masters: int) -> list[int]:
    """Shards of ``board`` on each master of a freshly formed cluster (master i owns master_slots'
    i-th range): one each is the layout the planner proposes."""
    ranges = master_slots(masters)
    counts = [0] * masters
    for prefix in board.prefixes:
        slot = slot_of(prefix)
        counts[next(i for i, (lo, hi) in enumerate(ranges) if lo <= slot <= hi)] += 1
    return counts


def replica_groups(master_ports: Sequence[int], replicas: Sequence[redis.Redis]) -> list[int]:
    """Each replica's master, as its index in ``master_ports`` (the replica's INFO replication)."""
    return [list(master_ports).index(int(r.info("replication")["master_port"])) for r in replicas]


def caught_up(
    masters: Sequence[redis.Redis], replicas: Sequence[redis.Redis], groups: Sequence[int]
) -> float:
    """Wait until every replica has applied what its master had written when this was called, by the
    replica's own offset (a master hears its replicas' offsets only once a second); the seconds it
    took."""
    t0 = time.perf_counter()
    wanted = [int(m.info("replication")["master_repl_offset"]) for m in masters]
    while True:
        behind = [
            r.connection_pool.connection_kwargs["port"]
            for r, g in zip(replicas, groups, strict=True)
            if int(r.info("replication")["slave_repl_offset"]) < wanted[g]
        ]
        if not behind:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > CATCH_UP_S:
            raise SystemExit(f"replicas on ports {behind} still behind their masters after {CATCH_UP_S:g} s")
        time.sleep(0.01)


@dataclass
class Meter:
    """Snapshots of the nodes' INFO cpu, this process's CPU and /proc/stat around a phase."""

    nodes: list[redis.Redis]  # the masters, then any replicas
    groups: list[int] = field(default_factory=list)  # each replica's master (replica_groups)
    marks: list[tuple[list[float], float, dict[int, tuple[int, int, int]]]] = field(default_factory=list)

    def mark(self) -> None:
        self.marks.append(([redis_cpu_s(n) for n in self.nodes], time.process_time(), read_stat()))

    def phase(self, phase: Phase) -> dict[str, Any]:
        """The figures of ``phase`` between the last two marks."""
        (m0, d0, s0), (m1, d1, s1) = self.marks[-2:]
        busy = sum(s1[c][0] - s0.get(c, (0, 0, 0))[0] for c in s1) / os.sysconf("SC_CLK_TCK")
        used = [b - a for a, b in zip(m0, m1, strict=True)]
        masters = len(used) - len(self.groups)
        out = figures(phase.items, phase.seconds, used[:masters], d1 - d0, busy - sum(used[masters:]))
        out |= replica_figures(phase.items, phase.seconds, used[masters:], self.groups)
        latency: dict[str, dict[str, float]] = phase.report()["latency_ms"]
        return {
            **out,
            "cpu_busy": busy_shares(s0, s1),
            "errors": phase.errors,
            "error_samples": phase.error_samples,
            "p99_ms": next(iter(latency.values()), {}).get("p99"),
        }


async def rank_reads(
    board: Board,
    workload: Workload,
    seconds: float,
    tasks: int,
    seed: int,
    max_age_ms: int = 0,
    polled: Sequence[str] = (),
) -> Phase:
    """``Board.player`` of random players for ``seconds``, ``tasks`` at a time (with ``max_age_ms``):
    drawn as the workload draws them, or uniformly from ``polled``."""
    rng = random.Random(seed)

    async def step(phase: Phase, _: int) -> None:
        t0 = time.perf_counter()
        player = rng.choice(polled) if polled else workload.player(rng)
        await board.player(player, max_age_ms=max_age_ms)
        phase.record("my rank", elapsed_ms(t0))

    return await run_phase(Phase("my rank"), seconds, tasks, step)


async def connected(url: str, s: Settings, read_from: str = "primary") -> tuple[RedisCluster, Scripts]:
    """The load generator's cluster client, with its scripts loaded (on the replicas too when
    ``read_from`` lets reads go there)."""
    client = connect(url, max_connections=max(64, 4 * max(s.write_tasks, s.read_tasks)), read_from=read_from)
    scripts = Scripts.register(client)
    await scripts.load(client)
    return client, scripts


async def measure(
    url: str, workload: Workload, s: Settings, nodes: list[redis.Redis], driver_cpu: int
) -> dict[str, Any]:
    """Preload the board, wait for quiet if asked, then the timed writes and reads with the load
    generator on ``driver_cpu``."""
    client, scripts = await connected(url, s)
    try:
        store = BoardStore(client, scripts)
        board = await store.get(workload.board)
        memory = await loaded(board, workload, nodes)
        out: dict[str, Any] = {
            "shards_on_masters": shards_on_masters(board, len(nodes)),
            "board_mib_on_masters": [round(m / 2**20, 1) for m in memory],
            "load_before_cores": round(wait_for_quiet(s.quiet_wait), 2) if s.quiet_wait else None,
        }
        out |= await phases(board, workload, s, Meter(nodes), driver_cpu)
        if s.band:
            banded = band_workload(workload)
            band = await store.get(banded.board)
            memory = await loaded(band, banded, nodes)
            out["band_mib_on_masters"] = [round(m / 2**20, 1) for m in memory]
            out["band_shards_on_masters"] = shards_on_masters(band, len(nodes))
            if s.quiet_wait:
                out["band_load_before_cores"] = round(wait_for_quiet(s.quiet_wait), 2)
            done = await phases(band, banded, s, Meter(nodes), driver_cpu)
            out |= {f"band_{kind}": figures for kind, figures in done.items()}
        return out
    finally:
        await client.aclose()


async def loaded(board: Board, workload: Workload, nodes: list[redis.Redis]) -> list[int]:
    """Preload ``board``; the bytes it took on each node."""
    base = [used_memory(n) for n in nodes]
    await population.load_board(board, workload)
    return [used_memory(n) - b for n, b in zip(nodes, base, strict=True)]


async def phases(
    board: Board, workload: Workload, s: Settings, meter: Meter, driver_cpu: int
) -> dict[str, Any]:
    """The timed writes, then the timed "my rank" reads of ``board``, each after a warm-up, with the
    load generator on ``driver_cpu``."""
    out: dict[str, Any] = {}
    with pinned(driver_cpu):
        await raw.writes(
            board, workload, s.warmup, s.write_tasks, s.batch_matches, seed=11, pool_matches=s.pool_matches
        )
        meter.mark()
        phase = await raw.writes(
            board, workload, s.seconds, s.write_tasks, s.batch_matches, seed=12, pool_matches=s.pool_matches
        )
        meter.mark()
        out["writes"] = meter.phase(phase)
        await rank_reads(board, workload, s.warmup, s.read_tasks, seed=21)
        meter.mark()
        phase = await rank_reads(board, workload, s.seconds, s.read_tasks, seed=22)
        meter.mark()
        out["reads"] = meter.phase(phase)
        # With max_age_ms: on the band board the other bands' sizes as an exact read kept them, on
        # the hash board the other shards' counts of a player read before at the same score.
        await rank_reads(board, workload, s.warmup, s.read_tasks, seed=23, max_age_ms=KEPT_AGE_MS)
        meter.mark()
        phase = await rank_reads(board, workload, s.seconds, s.read_tasks, seed=24, max_age_ms=KEPT_AGE_MS)
        meter.mark()
        out["reads_kept"] = meter.phase(phase)
        if board.layout.strategy == "hash":  # a screen polling the ranks of a few players
            polled = polled_players(workload)
            for kind, age in (("reads_polled", 0), ("reads_polled_kept", KEPT_AGE_MS)):
                await rank_reads(board, workload, s.warmup, s.read_tasks, 25, age, polled)
                meter.mark()
                phase = await rank_reads(board, workload, s.seconds, s.read_tasks, 26, age, polled)
                meter.mark()
                out[kind] = meter.phase(phase)
    return out


def polled_players(workload: Workload) -> list[str]:
    """POLLED_PLAYERS players of the population (the same in every run), read again and again."""
    picked = random.Random("polled").sample(range(workload.players), min(POLLED_PLAYERS, workload.players))
    return [f"p{i}" for i in picked]


def band_workload(workload: Workload) -> Workload:
    """The band board's workload: the same players, another board."""
    return replace(workload, board=f"{workload.board}-band")


async def measure_replicas(
    url: str, workload: Workload, s: Settings, nodes: list[redis.Redis], groups: list[int], driver_cpu: int
) -> dict[str, Any]:
    """Preload the board, wait for the replicas to catch up (and for quiet if asked), then the timed
    "my rank" reads with the load generator on ``driver_cpu``: from the primaries, then from the
    replicas. One READONLY client (``read_from="replicas"``) and two boards on it, as the router
    makes them (router/service.py): only the store's ``read_replicas`` differs."""
    client, scripts = await connected(url, s, read_from="replicas")
    try:
        on_primaries = await BoardStore(client, scripts).get(workload.board)
        store = BoardStore(client, scripts)
        store.read_replicas = True
        on_replicas = await store.get(workload.board)
        await population.load_board(on_primaries, workload)
        masters = len(nodes) - len(groups)
        out: dict[str, Any] = {
            "replicas_caught_up_ms": round(caught_up(nodes[:masters], nodes[masters:], groups) * 1000),
            "load_before_cores": round(wait_for_quiet(s.quiet_wait), 2) if s.quiet_wait else None,
        }
        meter = Meter(nodes, groups)
        with pinned(driver_cpu):
            for kind, board, seed in (("primaries", on_primaries, 31), ("replicas", on_replicas, 41)):
                await rank_reads(board, workload, s.warmup, s.read_tasks, seed)
                meter.mark()
                phase = await rank_reads(board, workload, s.seconds, s.read_tasks, seed + 1)
                meter.mark()
                out[f"reads_from_{kind}"] = meter.phase(phase)
        return out
    finally:
        await client.aclose()


@dataclass
class PinnedCluster:
    """A private cluster with every node pinned to its CPU, and a client of each node."""

    cluster: LocalCluster
    nodes: list[redis.Redis]  # the masters, then the replicas (port order)
    where: Placement
    pins: list[dict[str, Any]]


@contextlib.contextmanager
def pinned_cluster(masters: int, replicas: int, cpus: Sequence[int], dir: Path) -> Iterator[PinnedCluster]:
    """Start a cluster in ``dir``, pin its nodes (``placement``); stop it and remove ``dir`` after."""
    cluster: LocalCluster = start_cluster(masters, replicas, dir, start=FIRST_PORT)
    nodes = [redis.Redis(host="127.0.0.1", port=p) for p in cluster.ports]
    try:
        where = placement(masters, cpus, replicas)
        master_pids, replica_pids = node_pids(cluster)
        pins = [
            {"port": port, "pid": pid, "cpu": cpu, "affinity": pin(pid, cpu)}
            for port, pid, cpu in zip(
                cluster.ports, master_pids + replica_pids, where.masters + where.replicas, strict=True
            )
        ]
        yield PinnedCluster(cluster, nodes, where, pins)
    finally:
        for n in nodes:
            n.close()
        cluster.down()
        shutil.rmtree(dir, ignore_errors=True)


def point(masters: int, s: Settings, workload: Workload, cpus: Sequence[int], dir: Path) -> dict[str, Any]:
    """One cluster of ``masters`` masters: start, pin, create and load the board, measure, stop."""
    with pinned_cluster(masters, 0, cpus, dir) as bed:
        where = bed.where
        shards = masters * s.shards_per_master
        asyncio.run(create_board(bed.cluster.url, workload, shards))
        bands = band_sharding(workload, masters)
        if s.band:
            asyncio.run(create_board(bed.cluster.url, band_workload(workload), masters, sharding=bands))
        log(
            f"{masters} master(s) on CPUs {list(where.masters)}, load generator on CPU {where.driver}, "
            f"{shards} shard(s)" + (f"; a band board of bands from {bands['bands']}" if s.band else "")
        )
        measured = asyncio.run(measure(bed.cluster.url, workload, s, bed.nodes, where.driver))
        log(
            f"{masters} master(s): {measured['writes']['ops_per_s']:,.0f} writes/s, "
            f"{measured['reads']['ops_per_s']:,.0f} reads/s"
            + (f"; band board {measured['band_reads']['ops_per_s']:,.0f} reads/s" if s.band else "")
        )
        return {
            "masters": masters,
            "shards": shards,
            **({"bands": bands["bands"]} if s.band else {}),
            "placement": asdict(where),
            "cpus_shared": where.shared(),
            "pinned": bed.pins,
            **measured,
        }


def replica_point(
    replicas: int, s: Settings, workload: Workload, cpus: Sequence[int], dir: Path
) -> dict[str, Any]:
    """One cluster of ``s.replica_masters`` masters with ``replicas`` replicas each: start, pin,
    create and load the board, the reads from primaries and from replicas, stop."""
    masters = s.replica_masters
    with pinned_cluster(masters, replicas, cpus, dir) as bed:
        where = bed.where
        groups = replica_groups(bed.cluster.ports[:masters], bed.nodes[masters:])
        shards = masters * s.shards_per_master
        asyncio.run(create_board(bed.cluster.url, workload, shards))
        log(
            f"{masters} master(s) on CPUs {list(where.masters)}, {replicas} replica(s) each on CPUs "
            f"{list(where.replicas)}, load generator on CPU {where.driver}, {shards} shard(s)"
        )
        measured = asyncio.run(
            measure_replicas(bed.cluster.url, workload, s, bed.nodes, groups, where.driver)
        )
        log(
            f"{masters} master(s) x {replicas} replica(s): "
            f"{measured['reads_from_primaries']['ops_per_s']:,.0f} reads/s from primaries, "
            f"{measured['reads_from_replicas']['ops_per_s']:,.0f} from replicas"
        )
        return {
            "masters": masters,
            "replicas": replicas,
            "shards": shards,
            "placement": asdict(where),
            "cpus_shared": where.shared(),
            "pinned": bed.pins,
            "replica_groups": groups,
            **measured,
        }


def run(s: Settings, workload: Workload, out: Path) -> dict[str, Any]:
    """Every master count in turn, then every replica count, each on its own cluster under ``out``."""
    cpus = sorted(os.sched_getaffinity(0))
    return {
        "machine": machine(),
        "cpus": cpus,
        "settings": asdict(s),
        "workload": {"players": workload.players, "players_per_match": workload.players_per_match},
        "points": [point(m, s, workload, cpus, out / f"cluster-{m}") for m in s.masters],
        "replica_points": [
            replica_point(r, s, workload, cpus, out / f"cluster-{s.replica_masters}x{r}") for r in s.replicas
        ],
    }


def _ratio(points: list[dict[str, Any]], kind: str, key: str) -> str:
    first, last = points[0][kind].get(key), points[-1][kind].get(key)
    return f"{last / first:.2f}x" if first and last else "-"


def _cell(values: Sequence[float]) -> str:
    return " / ".join(f"{v:g}" for v in values)


def _busy(f: dict[str, Any]) -> str:
    return " / ".join(f"{share:.0%}" for _, share in sorted(f.get("cpu_busy", {}).items()))


def _shares(shares: Sequence[float], groups: Sequence[int]) -> str:
    """Replica shares grouped by master: ``50% + 50% / 49% + 51%``."""
    return " / ".join(
        " + ".join(f"{s:.0%}" for s, g in zip(shares, groups, strict=True) if g == master)
        for master in sorted(set(groups))
    )


def table(points: list[dict[str, Any]], kind: str, unit: str) -> list[str]:
    """A markdown table of one phase kind ('writes' or 'reads') over the master counts."""
    lines = [
        f"| masters | CPU of each master / load generator | {unit}/s | Redis µs per {unit[:-1]}, each master "
        f"| all masters | {unit}/s at 1 core per master | load generator µs per {unit[:-1]} | its cores | "
        "CPUs busy | other processes' cores | errors |",
        "|---:|---|---:|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for p in points:
        f = p[kind]
        where = p["placement"]
        busy = _busy(f)
        lines.append(
            f"| {p['masters']} | {_cell(where['masters'])} / {where['driver']} | {f['ops_per_s']:,.0f} | "
            f"{_cell(f.get('redis_us_per_op', []))} | {f.get('redis_us_per_op_all', '-')} | "
            f"{f.get('ceiling_per_s') or 0:,} | {f.get('driver_us_per_op', '-')} | "
            f"{f.get('driver_cores', '-')} | {busy} | {f.get('other_cores', '-')} | {f.get('errors', 0)} |"
        )
    return lines


def replica_table(points: list[dict[str, Any]]) -> list[str]:
    """A markdown table of the replicas sweep: each cluster's reads from its primaries, then from its
    replicas. 'At 1 core per busiest node': the busiest master's ceiling for reads from primaries,
    the busiest replica's for reads from replicas."""
    lines = [
        "| replicas per master | reads from | CPU of each master; each replica; load generator | reads/s "
        "| Redis µs per read, all masters | all replicas | busiest replica | each replica's share of its "
        "master's replicas' CPU | reads/s at 1 core per busiest node | load generator µs per read | "
        "CPUs busy | other processes' cores | errors |",
        "|---:|---|---|---:|---:|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    for p in points:
        where = p["placement"]
        cpus = f"{_cell(where['masters'])}; {_cell(where['replicas'])}; {where['driver']}"
        for kind in ("primaries", "replicas"):
            f = p[f"reads_from_{kind}"]
            ceiling = f.get("replica_ceiling_per_s" if kind == "replicas" else "ceiling_per_s")
            shares = _shares(f.get("replica_shares", []), p["replica_groups"]) if kind == "replicas" else "-"
            lines.append(
                f"| {p['replicas']} | {kind} | {cpus} | {f['ops_per_s']:,.0f} | "
                f"{f.get('redis_us_per_op_all', '-')} | {f.get('replica_us_per_op_all', '-')} | "
                f"{f.get('replica_us_per_op_busiest', '-')} | {shares or '-'} | {ceiling or 0:,} | "
                f"{f.get('driver_us_per_op', '-')} | {_busy(f)} | {f.get('other_cores', '-')} | "
                f"{f.get('errors', 0)} |"
            )
    return lines


def replica_findings(points: list[dict[str, Any]]) -> list[str]:
    """What the replicas sweep's costs say, one bullet per cluster and one across them, each beside
    the model: R replicas per master each carry 1/R of their master's group's reads."""
    lines = []
    for p in points:
        r = p["replicas"]
        primaries, replicas = p["reads_from_primaries"], p["reads_from_replicas"]
        master_us, replica_us = (
            primaries.get("redis_us_per_op", []),
            replicas.get("replica_us_per_op_busiest"),
        )
        shares = replicas.get("replica_shares", [])
        if not master_us or not replica_us or not shares:
            continue
        before, after = primaries.get("ceiling_per_s"), replicas.get("replica_ceiling_per_s")
        gain = f"{after / before:.2f}x" if before and after else "-"
        lines.append(
            f"- {r} replica(s) per master: the busiest replica spent {replica_us:g} µs per read, the busiest "
            f"master {max(master_us):g} when the primaries served them; reads/s at 1 core per busiest node "
            f"{before or 0:,} from the primaries, {after or 0:,} from the replicas ({gain}; the model: "
            f"{r}x). Each replica's share of its master's replicas' CPU: {min(shares):.0%} to "
            f"{max(shares):.0%} (the model, 1/{r}: {1 / r:.0%}); each master's replicas spent "
            f"{_group_us(p):.1f} µs per read in all. The masters spent "
            f"{replicas.get('redis_us_per_op_all', '-')} µs per read in all while the replicas served."
        )
    usable = [p for p in points if p["reads_from_replicas"].get("replica_ceiling_per_s")]
    if len(usable) >= 2:
        first, last = usable[0], usable[-1]
        us = [p["reads_from_replicas"]["replica_us_per_op_busiest"] for p in (first, last)]
        ceilings = [p["reads_from_replicas"]["replica_ceiling_per_s"] for p in (first, last)]
        lines.append(
            f"- From {first['replicas']} to {last['replicas']} replicas per master: the busiest replica's "
            f"µs per read {us[1] / us[0]:.2f}x, reads/s at 1 core per busiest replica "
            f"{ceilings[1] / ceilings[0]:.2f}x (the model: {first['replicas'] / last['replicas']:.2f}x and "
            f"{last['replicas'] / first['replicas']:.2f}x); each master's replicas' µs per read in all "
            f"{_group_us(last) / _group_us(first):.2f}x (the model: 1.00x, a read costing a group the same "
            "however many replicas share it)."
        )
    return lines


def _group_us(p: dict[str, Any]) -> float:
    """What one master's replicas spent per read from the replicas, in all (the mean over masters)."""
    return float(p["reads_from_replicas"]["replica_us_per_op_all"]) / p["masters"]


STALENESS = (
    "A replica serves what it has received: a write acknowledged in the last moments (the replication "
    "lag, usually well under a millisecond; longer while a replica resynchronises or is cut off) may "
    "not show yet, so a player can read their rank from before their last match (router/README.md, "
    '[Reads and caches](../../../router/README.md#reads-and-caches), "Reads from replicas"). The read '
    "phases here write nothing; they start once every replica has applied the preload"
)


TWO_CORES = (
    "What two cores can show: what each operation costs each master (a write costs the one master "
    "of its shard; an exact read costs every master), hence that write capacity and memory divide "
    "over the masters and read capacity does not; and what the library itself spends per "
    "operation. What they cannot show: the throughput of three masters on three cores. From two "
    "masters on, the load generator shares a core with a master, and the third master shares one "
    "with the first; the writes/s and reads/s above are bounded by the two cores, not by Redis. The "
    "'at 1 core per master' columns are a model: this run's per-master costs, assumed to hold when "
    "each master has a core of its own. Loopback has no network either: a real round trip adds "
    "latency, not master CPU. The replicas sweep has the same limit: its nodes and the load "
    "generator share the two cores, so its reads/s are bounded by them; what it measures is what "
    "each read costs each replica, and its 'at 1 core per busiest node' column is the same model."
)


def _waited(points: list[dict[str, Any]], s: dict[str, Any]) -> list[str]:
    loads = [p.get("load_before_cores") for p in points]
    if all(load is None for load in loads):
        return []
    cores = " / ".join("-" if load is None else f"{load:g}" for load in loads)
    return [
        f"Other load on the machine as each cluster's phases began (after waiting up to {s['quiet_wait']} s "
        f"for it to drop): {cores} cores.",
        "",
    ]


def replica_section(points: list[dict[str, Any]], s: dict[str, Any]) -> list[str]:
    """The replicas sweep's part of the report; nothing when it did not run."""
    if not points:
        return []
    caught = " / ".join(str(p.get("replicas_caught_up_ms", "-")) for p in points)
    return [
        f'## "My rank" reads from replicas ({points[0]["masters"]} masters, '
        f"{', '.join(str(p['replicas']) for p in points)} replica(s) each, {s['read_tasks']} at a time)",
        "",
        'One READONLY client (`connect(url, read_from="replicas")`); the reads of each cluster first '
        "from a board that reads its primaries, then from one whose reads go to the replicas "
        "(`BoardStore.read_replicas`, as the router's `SHARDLB_READ_FROM=replicas`): each batch of a read "
        "goes to one replica of each master, the master's replicas in turn (round robin).",
        "",
        *replica_table(points),
        "",
        *replica_findings(points),
        "",
        f"{STALENESS} ({caught} ms after its last write, with "
        f"{' / '.join(str(p['replicas']) for p in points)} replica(s) per master).",
        "",
    ]


def band_section(points: list[dict[str, Any]], s: dict[str, Any]) -> list[str]:
    """The band board's tables: one home shard and one band per master (none when not measured)."""
    if not all("band_reads" in p for p in points):
        return []
    starts = "; ".join(f"{p['masters']}: {p.get('bands')}" for p in points)
    return [
        f"## Band board: one home shard and one band per master (band starts by masters: {starts})",
        "",
        'The same players on a band board (docs/design-notes.md, "Band boards"): a player\'s total on '
        "their home shard (by hash) and on the band shard of their points. A rank is the sizes of the "
        "bands ahead (ZCARD) plus one ZREVRANK in the player's own band, so only the home shard and the "
        "player's band walk a skip list; every other master answers three O(1) commands.",
        "",
        f"### Writes ({s['write_tasks']} batches of {s['batch_matches']} matches in flight)",
        "",
        *table(points, "band_writes", "writes"),
        "",
        f'### "My rank" reads (Board.player, {s["read_tasks"]} at a time)',
        "",
        *table(points, "band_reads", "reads"),
        "",
        *kept_section(points, s),
    ]


def kept_section(points: list[dict[str, Any]], s: dict[str, Any]) -> list[str]:
    """The band board's "my rank" with max_age_ms (none when not measured)."""
    if not all("band_reads_kept" in p for p in points):
        return []
    return [
        f'### "My rank" reads with `max_age_ms={KEPT_AGE_MS}` (Board.player, {s["read_tasks"]} at a time)',
        "",
        f"The other bands' sizes as this process's last exact read took them, up to {KEPT_AGE_MS} ms "
        "before (the router's `GET .../players/{player}?max_age_ms=`): a read sends a ZSCORE to the "
        "player's home shard, then ZSCORE, ZREVRANK and ZCARD to their own band, and nothing to the "
        "other masters; one read in each second is exact and keeps the sizes for the next.",
        "",
        *table(points, "band_reads_kept", "reads"),
        "",
    ]


def hash_kept_section(points: list[dict[str, Any]], s: dict[str, Any]) -> list[str]:
    """The hash board's "my rank" with max_age_ms (none when not measured)."""
    if not all("reads_kept" in p for p in points) or not points:
        return []
    first, last = points[0]["masters"], points[-1]["masters"]
    return [
        f'### "My rank" reads with `max_age_ms={KEPT_AGE_MS}` (Board.player, {s["read_tasks"]} at a time)',
        "",
        "The other shards' counts for a player as this process's last such read of that player took "
        f"them, up to {KEPT_AGE_MS} ms before, while the player's home shard holds the same score: "
        "such a read is one round to the home shard's node (ZSCORE, ZREVRANK, ZCARD). A player's "
        "first read, or one past the age, counts every shard and keeps the counts. The players are "
        "drawn as the exact reads' are (Zipf-like): the share read again within the age is what "
        "this saves.",
        "",
        *table(points, "reads_kept", "reads"),
        "",
        f"From {first} to {last} master(s): reads/s at 1 core per master "
        f"{_ratio(points, 'reads_kept', 'ceiling_per_s')} "
        f"(exact: {_ratio(points, 'reads', 'ceiling_per_s')}; "
        f"in proportion to the masters: {last / first:.2f}x); Redis µs per read in all masters "
        f"{_ratio(points, 'reads_kept', 'redis_us_per_op_all')}.",
        "",
        *polled_section(points, s),
    ]


def polled_section(points: list[dict[str, Any]], s: dict[str, Any]) -> list[str]:
    """The hash board's polled reads, exact and with max_age_ms (none when not measured)."""
    if not points or not all("reads_polled" in p and "reads_polled_kept" in p for p in points):
        return []
    return [
        f'### "My rank" of {POLLED_PLAYERS} players, read again and again (Board.player, '
        f"{s['read_tasks']} at a time)",
        "",
        f"Players drawn uniformly from {POLLED_PLAYERS} of the population, as screens that poll: each "
        f"read again well within {KEPT_AGE_MS} ms. Exact:",
        "",
        *table(points, "reads_polled", "reads"),
        "",
        f"With `max_age_ms={KEPT_AGE_MS}`:",
        "",
        *table(points, "reads_polled_kept", "reads"),
        "",
        f"At {points[-1]['masters']} master(s), Redis µs per read in all masters: "
        f"{_at(points, 'reads_polled', 'redis_us_per_op_all')} exact, "
        f"{_at(points, 'reads_polled_kept', 'redis_us_per_op_all')} with `max_age_ms`; the load "
        f"generator's µs per read {_at(points, 'reads_polled', 'driver_us_per_op')} and "
        f"{_at(points, 'reads_polled_kept', 'driver_us_per_op')}. From {points[0]['masters']} to "
        f"{points[-1]['masters']} master(s), reads/s at 1 core per master "
        f"{_ratio(points, 'reads_polled', 'ceiling_per_s')} exact and "
        f"{_ratio(points, 'reads_polled_kept', 'ceiling_per_s')} with it.",
        "",
    ]


def _at(points: list[dict[str, Any]], kind: str, field: str) -> str:
    value = points[-1].get(kind, {}).get(field)
    return "-" if value is None else f"{value:g}"


def band_findings(points: list[dict[str, Any]]) -> list[str]:
    """How the band board's reads grew with the masters, beside the hash board's."""
    if not all("band_reads" in p for p in points) or len(points) < 2:
        return []
    first, last = points[0]["masters"], points[-1]["masters"]
    return [
        f"Band board, from {first} to {last} master(s): reads/s at 1 core per master "
        f"{_ratio(points, 'band_reads', 'ceiling_per_s')} (the hash board's: "
        f"{_ratio(points, 'reads', 'ceiling_per_s')}; in proportion to the masters: {last / first:.2f}x); "
        f"Redis µs per read in all masters {_ratio(points, 'band_reads', 'redis_us_per_op_all')}; writes/s "
        f"at 1 core per master {_ratio(points, 'band_writes', 'ceiling_per_s')}.",
        "",
        *(
            [
                f"With `max_age_ms={KEPT_AGE_MS}`, from {first} to {last} master(s): reads/s at 1 core per "
                f"master {_ratio(points, 'band_reads_kept', 'ceiling_per_s')} (in proportion to the masters: "
                f"{last / first:.2f}x); Redis µs per read in all masters "
                f"{_ratio(points, 'band_reads_kept', 'redis_us_per_op_all')}.",
                "",
            ]
            if all("band_reads_kept" in p for p in points)
            else []
        ),
    ]


def memory_table(points: list[dict[str, Any]]) -> list[str]:
    banded = all("band_mib_on_masters" in p for p in points)
    head = "| masters | board MiB on each master | shards on each master |"
    rule = "|---:|---|---|"
    if banded:
        head += " band board MiB on each master | its shards (home and band) on each master |"
        rule += "---|---|"
    rows = []
    for p in points:
        row = f"| {p['masters']} | {_cell(p['board_mib_on_masters'])} | {_cell(p['shards_on_masters'])} |"
        if banded:
            row += f" {_cell(p['band_mib_on_masters'])} | {_cell(p['band_shards_on_masters'])} |"
        rows.append(row)
    return [head, rule, *rows]


def markdown(result: dict[str, Any]) -> str:
    points = result["points"]
    replica_points = result.get("replica_points", [])
    s = result["settings"]
    m = result["machine"]
    with_replicas = (
        f", then of {replica_points[0]['masters']} masters with "
        f"{', '.join(str(p['replicas']) for p in replica_points)} replica(s) each"
        if replica_points
        else ""
    )
    lines = [
        f"# shardlb bench-scaleout {result['name']}",
        "",
        f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), this run on CPUs {result['cpus']}; {m['redis']}. "
        f"Clusters of {', '.join(str(p['masters']) for p in points)} master(s) without replicas"
        f"{with_replicas}, each redis-server pinned to one CPU (taskset); one hash board of "
        f"{s['shards_per_master']} shard(s) per master, {result['workload']['players']:,} players "
        f"preloaded; one load generator process (the library, no HTTP) pinned to a CPU; "
        f"{s['seconds']} s a phase.",
        "",
        f"## Writes ({s['write_tasks']} batches of {s['batch_matches']} matches in flight)",
        "",
        *table(points, "writes", "writes"),
        "",
        f'## "My rank" reads (Board.player, {s["read_tasks"]} at a time)',
        "",
        *table(points, "reads", "reads"),
        "",
        *hash_kept_section(points, s),
        *band_section(points, s),
        "## Memory",
        "",
        *memory_table(points),
        "",
        f"From {points[0]['masters']} to {points[-1]['masters']} master(s): writes/s "
        f"{_ratio(points, 'writes', 'ops_per_s')}, writes/s at 1 core per master "
        f"{_ratio(points, 'writes', 'ceiling_per_s')}; reads/s {_ratio(points, 'reads', 'ops_per_s')}, "
        f"reads/s at 1 core per master {_ratio(points, 'reads', 'ceiling_per_s')}; Redis µs per read in "
        f"all masters {_ratio(points, 'reads', 'redis_us_per_op_all')}.",
        "",
        *band_findings(points),
        *replica_section(replica_points, s),
        *_waited([*points, *replica_points], s),
        "'At 1 core per master' = 1,000,000 / the busiest master's µs per operation: the rate at which "
        "it would fill one core of its own (the planner budgets half a core). 'Other processes' "
        "cores' is CPU the run's own processes did not spend: other work on the machine.",
        "",
        TWO_CORES,
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    s = Settings.from_env()
    workload = replace(Workload.from_env(), board="scaleout", players=s.players)
    name = time.strftime("scaleout-%Y%m%d-%H%M%S")
    out = run_dir(name)
    result = {"name": name, **run(s, workload, out)}
    (out / "scaleout.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "scaleout.md").write_text(markdown(result))
    publish(out, FILES)
    print((out / "scaleout.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
