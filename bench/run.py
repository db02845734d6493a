"""`make bench`: one ~6 minute headless run that puts shardlb's HTTP figures beside their limit and
their rivals, and the journal's cost beside a board without one, all measured in the same run, on
the same cluster and the same preloaded players.

    python -m bench.run            # settings: SHARDLB_BENCH_* variables, see Settings

Steps: start a local cluster; preload the population into the sharded board, the textbook sorted
set and PostgreSQL; HTTP write ramp and read mix through the router with Locust; the write latency
curve (constant-rate steps at shares of the ramp's sustained rate); the raw limit (same writes and
reads through the library, no HTTP); the textbook design; PostgreSQL; the hot reads of one router
process beside the textbook service (bench/hot.py), which loads a board of one shard per master;
the HTTP read mix again on that board; short sweeps over router processes and cluster masters;
the durability phases (journal and archiver on beside off, replica acknowledgement beside primary)
and the journal's memory per result. Results go to bench/results/<timestamp>/ and
summary.md/summary.json are copied to bench/results/latest/.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import drivers, hot, journal, locust_csv, report, server_latency, shapes
from bench.commandstats import CommandMeter
from bench.drivers import Job
from bench.durability import ArchiveDatabase, ArchiverProcess, JournalPhase, router_knows
from bench.harness import int_list, log, publish, run_dir
from bench.population import load_parallel as population_load
from bench.procs import CpuMeter, descendants, machine_cpu_seconds
from bench.services import ROOT, LocustRun, Router, free_port, router_missing, run_locust
from bench.testbed import create_board, machine, node_pids, pg_preload, postgres_pids, preload, start_cluster
from bench.workload import Workload
from shardlb.cluster import LocalCluster
from shardlb.nodes import ClusterError

ADMIN_KEY = "bench-admin"
WRITE_KEY = "bench-write"
GOAL_WRITES = 50_000
GOAL_RATIO = 0.6
# The band board's write step (band_writes): past the sustained maximum, so both boards show their limit.
BAND_WRITE_SHARE = 1.25
QUIET_CORES = 0.3


@dataclass(frozen=True)
class Settings:
    """Every knob of a run; ``from_env`` reads SHARDLB_BENCH_<NAME> (e.g. SHARDLB_BENCH_PLAYERS)."""

    players: int = 1_000_000
    shards: int = 16
    masters: int = 3
    replicas: int = 1
    router_workers: int = 2  # the read mixes' routers
    # The write phases' routers (ramp, latency steps, board comparison, durability). One process:
    # each process batches its own requests, so on these two cores, shared with Redis and Locust, a
    # second one makes smaller script calls and costs more CPU per score for no more writes/s (the
    # router sweep measures both; router/README.md "Workers and batches"). Kubernetes runs one a pod.
    write_workers: int = 1
    locust_processes: int = 2
    driver_processes: int = 2
    light_users: int = 256  # the light client's connections when it drives the router to its maximum
    light_matches: int = 10  # matches a request in its second maximum (1: not measured)
    target_writes: int = 50_000
    ramp_seconds: float = 48.0
    ramp_steps: int = 6
    user_rps: float = 5.0
    read_seconds: float = 15.0
    read_users: int = 40
    read_profile: int = 1  # 0: no py-spy profile of a router worker after each read mix
    raw_seconds: float = 20.0  # at most; the raw writes stop once they have written what the ramp wrote
    peer_seconds: float = 6.0
    sweep_seconds: float = 8.0
    latency_shares: str = "0.5,0.8"  # the latency curve's steps, as shares of the ramp's sustained rate
    durability_seconds: float = 8.0  # each phase of the durability comparison
    drain_wait: float = 60.0  # after a journaled phase, wait up to this long for the archive to catch up
    sweep_masters: str = "1,2,3"
    sweep_routers: str = "1,2"
    write_concurrency: int = 4
    batch_matches: int = 100
    read_concurrency: int = 16
    pg_dsn: str = "host=127.0.0.1 port=5432 user=postgres dbname=test"
    quiet_wait: float = 0.0  # wait up to this many seconds for other load to fall below QUIET_CORES

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ) if env is None else env
        values: dict[str, Any] = {}
        for name, default in asdict(cls()).items():
            raw = env.get(f"SHARDLB_BENCH_{name.upper()}")
            if raw is None or raw == "":
                continue
            try:
                values[name] = type(default)(raw)
            except ValueError as e:
                raise SystemExit(
                    f"SHARDLB_BENCH_{name.upper()}: expected {type(default).__name__}, got {raw!r}"
                ) from e
        return cls(**values)

    def __post_init__(self) -> None:
        self.shares()

    def shares(self) -> list[float]:
        """SHARDLB_BENCH_LATENCY_SHARES as numbers, at least one, each above 0."""
        try:
            shares = [float(v) for v in self.latency_shares.split(",") if v.strip()]
        except ValueError:
            shares = []
        if not shares or min(shares) <= 0:
            raise SystemExit(
                "SHARDLB_BENCH_LATENCY_SHARES: expected comma-separated shares of the sustained rate "
                f"above 0 such as 0.5,0.8, got {self.latency_shares!r}"
            )
        return shares


def measured(
    groups: dict[str, list[int]], action: Callable[[], Any], store_url: str | None = None
) -> tuple[Any, dict[str, Any]]:
    """Run ``action`` while metering the CPU of ``groups`` (and, with ``store_url``, the commands
    the cluster ran: ``cpu["commands"]``, bench/commandstats.py)."""
    commands = CommandMeter(store_url).start() if store_url else None
    meter = CpuMeter(groups).start()
    try:
        result = action()
    finally:
        cpu = meter.stop()
        if commands is not None:
            cpu["commands"] = commands.stop()
    return result, cpu


def driver_phase(job: Job, processes: int, groups: dict[str, list[int]]) -> dict[str, Any]:
    log(f"{job.kind}: {processes} processes x {job.concurrency} callers, {job.seconds:.0f} s")
    store = job.url if "redis masters" in groups else None
    (phase, _), cpu = measured(groups, lambda: drivers.fan_out(job, processes), store)
    out = phase.report()
    # The drivers are this process's children: "harness" holds them, start-up included; the driver's
    # own count (phase only) is what the costs use.
    cpu["cpu_s"]["driver"] = cpu["cpu_s"].pop("harness")
    cpu["cores_during_phase"] = {k: round(v / phase.seconds, 2) for k, v in cpu["cpu_s"].items()}
    out["cpu"] = cpu
    log(f"{job.kind}: {out['items_per_s']:.0f}/s, {out['errors']} errors")
    return out


def locust_env(s: Settings, workload: Workload, extra: dict[str, str]) -> dict[str, str]:
    return {
        "SHARDLB_BOARD": workload.board,
        "SHARDLB_PLAYERS": str(workload.players),
        "SHARDLB_WRITE_KEY": WRITE_KEY,
        "SHARDLB_ADMIN_KEY": "",
        "SHARDLB_USER_RPS": str(s.user_rps),
        **extra,
    }


def http_phases(
    s: Settings, workload: Workload, cluster: LocalCluster, out: Path, redis: dict[str, list[int]]
) -> dict[str, Any]:
    """The HTTP write ramp through a router of s.write_workers processes, then the read mix through a
    fresh router of s.router_workers processes."""
    missing = router_missing()
    if missing:
        log(missing)
        return {"skipped": missing}
    result: dict[str, Any] = {
        "router_workers": s.write_workers,
        "read_router_workers": s.router_workers,
        "locust_processes": s.locust_processes,
    }
    router = Router(cluster.url, free_port(22400), s.write_workers, out / "router.log", router_env())
    with router:
        groups = {**redis, "router": [router.proc.pid] if router.proc else []}
        log(
            f"HTTP write ramp to {s.target_writes} writes/s over {s.ramp_seconds:.0f} s "
            f"({s.write_workers} router workers, {s.locust_processes} Locust processes)"
        )
        run = run_locust(
            out / "http-writes",
            router.url,
            ["GameServer"],
            locust_env(
                s,
                workload,
                {
                    "SHARDLB_SHAPE": "ramp",
                    "SHARDLB_TARGET_WRITES": str(s.target_writes),
                    "SHARDLB_DURATION": str(s.ramp_seconds),
                    "SHARDLB_STEPS": str(s.ramp_steps),
                },
            ),
            s.locust_processes,
            [],
            groups,
            s.ramp_seconds + 90,
            cluster.url,
        )
        stages = shapes.schedule(
            "ramp",
            s.target_writes,
            s.ramp_seconds,
            s.user_rps,
            workload.players_per_match,
            s.ramp_steps,
            workload.fresh_share,
        )
        result["writes"] = report.http_writes(run, stages)
        log(f"HTTP writes: sustained {result['writes']['sustained_writes_per_s']:.0f}/s")
    reads = _reads_through_own_router(s, workload, cluster, out, redis, "reads")
    result["reads"] = {k: v for k, v in reads.items() if k != "board"}
    return result


def read_mix(
    s: Settings,
    workload: Workload,
    url: str,
    prefix: Path,
    groups: dict[str, list[int]],
    store_url: str | None = None,
) -> dict[str, Any]:
    """The HTTP read mix: s.read_users Locust "Player" users reading back to back for s.read_seconds,
    CPU metered over ``groups`` (and the commands of the cluster at ``store_url``)."""
    log(f"HTTP read mix on {workload.board}: {s.read_users} users for {s.read_seconds:.0f} s")
    env, args = _readers(s, workload, s.read_seconds)
    run = run_locust(
        prefix, url, ["Player"], env, s.locust_processes, args, groups, s.read_seconds + 60, store_url
    )
    reads = report.http_reads(run)
    log(f"HTTP reads on {workload.board}: {reads['reads_per_s']:.0f}/s")
    return reads


def _readers(s: Settings, workload: Workload, seconds: float) -> tuple[dict[str, str], list[str]]:
    """The read mix's Locust settings and arguments: s.read_users "Player" users reading back to
    back for ``seconds``."""
    env = locust_env(s, workload, {"SHARDLB_READER_RPS": "1000"})
    return env, ["-u", str(s.read_users), "-r", str(s.read_users), "-t", f"{seconds:.0f}s"]


def _profiled_reads(s: Settings, workload: Workload, router: Router, prefix: Path) -> dict[str, Any]:
    """One router worker sampled by py-spy for PROFILE_S while the read mix's users read again
    after the metered window (READ_PROFILE_LEAD_S for Locust to start and its users to spawn
    first), so py-spy's CPU stays out of the mix's figures."""
    if hot.py_spy() is None:
        return {"skipped": "py-spy not installed (pip install py-spy)"}
    if router.proc is None:
        return {"skipped": "the router is not running"}
    seconds = READ_PROFILE_LEAD_S + PROFILE_S + 2
    env, args = _readers(s, workload, seconds)
    load = threading.Thread(
        target=run_locust,
        args=(prefix, router.url, ["Player"], env, s.locust_processes, args, {}, seconds + 60),
    )
    load.start()
    try:
        time.sleep(READ_PROFILE_LEAD_S)
        return hot.sample(router_worker(router.proc.pid), PROFILE_S, Path(f"{prefix}.spy"))
    finally:
        load.join()


def planned_reads(
    s: Settings,
    workload: Workload,
    cluster: LocalCluster,
    out: Path,
    redis: dict[str, list[int]],
    hot_run: dict[str, Any],
) -> dict[str, Any]:
    """The HTTP read mix again, on the board of one shard per master (the layout `shardlb plan`
    recommends) with the same players, through a router of its own as in http_phases. The board is
    the one the hot phase loaded (bench/hot.py), or loaded here when that phase was skipped."""
    board = hot.hot_board_workload(workload, s.masters)
    if hot_run.get("hot_board") != board.board and not router_missing():
        log(f"loading {board.board}: {s.masters} shards, the same {workload.players:,} players")
        hot.prepare(cluster.url, workload, s.masters, s.driver_processes)
    reads = _reads_through_own_router(s, board, cluster, out, redis, "planned")
    return reads if "skipped" in reads else {**reads, "shards": s.masters, "router_workers": s.router_workers}


def band_reads(
    s: Settings,
    workload: Workload,
    cluster: LocalCluster,
    out: Path,
    redis: dict[str, list[int]],
    hot_run: dict[str, Any],
) -> dict[str, Any]:
    """The HTTP read mix once more, on the band board of one home shard and one band per master
    with the same players (bench/hot.py ``band_sharding``), as ``planned_reads`` does."""
    board = hot.band_board_workload(workload, s.masters)
    if hot_run.get("band_board") != board.board and not router_missing():
        log(f"loading {board.board}: a band board, the same {workload.players:,} players")
        hot.prepare_band(cluster.url, workload, s.masters, s.driver_processes)
    reads = _reads_through_own_router(s, board, cluster, out, redis, "band")
    sharding = hot.band_sharding(workload, s.masters)
    return (
        reads if "skipped" in reads else {**reads, "shards": sharding["shards"], "bands": sharding["bands"]}
    )


def _reads_through_own_router(
    s: Settings, board: Workload, cluster: LocalCluster, out: Path, redis: dict[str, list[int]], name: str
) -> dict[str, Any]:
    """The read mix on ``board`` through a fresh router, CPU metered over ``redis`` and the router."""
    missing = router_missing()
    if missing:
        return {"skipped": missing}
    router = Router(cluster.url, free_port(22400), s.router_workers, out / f"{name}-router.log", router_env())
    with router:
        groups = {**redis, "router": [router.proc.pid] if router.proc else []}
        prefix = out / ("http-reads" if name == "reads" else f"http-reads-{name}")
        reads = read_mix(s, board, router.url, prefix, groups, cluster.url)
        if s.read_profile and reads.get("reads_per_s"):
            log(f"profiling a router worker under the read mix on {board.board}")
            reads["profile"] = _profiled_reads(s, board, router, Path(f"{prefix}-profile"))
    return {"board": board.board, **reads}


def band_writes(
    s: Settings,
    workload: Workload,
    cluster: LocalCluster,
    out: Path,
    redis: dict[str, list[int]],
    sustained: float | None,
) -> dict[str, Any]:
    """What a band board's reads cost on the write side: one short HTTP write step at the same
    offered rate (BAND_WRITE_SHARE of the ramp's sustained maximum) on the board of one shard per
    master and on the band board, both already loaded with the same players, each through a fresh
    router; writes/s and CPU per player-score write of the router and of the store."""
    missing = router_missing()
    if missing:
        return {"skipped": missing}
    offered = round(BAND_WRITE_SHARE * sustained) if sustained else s.target_writes
    result: dict[str, Any] = {"offered": offered}
    boards = {
        "hash": hot.hot_board_workload(workload, s.masters),
        "band": hot.band_board_workload(workload, s.masters),
    }
    for part, board in boards.items():
        point = soak(s, board, cluster, f"writes-{part}", out, redis, offered, s.write_workers)
        cpu, n = point["cpu"]["cpu_s"], point.get("scores_written") or 0
        store = sum(cpu.get(k, 0.0) for k in ("redis masters", "redis replicas"))
        result[part] = {
            "board": board.board,
            **point,
            "router_us_per_write": round(cpu.get("router", 0.0) / n * 1e6, 1) if n else None,
            "store_us_per_write": round(store / n * 1e6, 1) if n else None,
        }
    return result


def router_env() -> dict[str, str]:
    # The readers are many players from one address: the per-address read rate limit is off.
    return {"SHARDLB_ADMIN_KEYS": ADMIN_KEY, "SHARDLB_WRITE_KEYS": WRITE_KEY, "SHARDLB_READ_RATE": "0"}


def soak(
    s: Settings,
    workload: Workload,
    cluster: LocalCluster,
    name: str,
    out: Path,
    groups: dict[str, list[int]],
    offered: int,
    workers: int,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A short HTTP write step at ``offered`` writes/s through a router of ``workers`` processes
    started for it with ``env`` added to its settings; CPU metered over ``groups`` and the router."""
    run = soak_run(s, workload, cluster, name, out, groups, offered, workers, s.sweep_seconds + 4, env)
    point = report.sweep_point(run, window=max(3.0, s.sweep_seconds - 2))
    log(f"{name}: {point['writes_per_s']:.0f} writes/s, {point['failures']} failures")
    return point


def soak_run(
    s: Settings,
    workload: Workload,
    cluster: LocalCluster,
    name: str,
    out: Path,
    groups: dict[str, list[int]],
    offered: int,
    workers: int,
    seconds: float,
    env: dict[str, str] | None = None,
    server: list[server_latency.Buckets] | None = None,
    server_from_s: float = 0.0,
    profile: dict[str, Any] | None = None,
    profile_from_s: float = 0.0,
) -> LocustRun:
    """Locust's ``soak`` shape at ``offered`` writes/s for ``seconds`` (bench/shapes.py) through a
    fresh router of ``workers`` processes with ``env`` added to its settings. With ``server``, the
    router's own histogram of score writes is scraped into it about ``server_from_s`` seconds into
    the run and at its end (bench/server_latency.py). With ``profile``, one router worker is
    sampled by py-spy for PROFILE_S seconds from ``profile_from_s`` seconds into the run, folded
    into it (bench/hot.py, ``sample``)."""
    router = Router(
        cluster.url, free_port(22400), workers, out / f"{name}-router.log", {**router_env(), **(env or {})}
    )
    with router:
        log(f"{name}: {workers} router workers, {seconds:.0f} s at {offered} writes/s offered")
        timer = spying = None
        if server is not None:
            timer = threading.Timer(server_from_s, lambda: server.append(server_latency.scrape(router.url)))
            timer.start()
        if profile is not None and router.proc is not None:
            root, raw = router.proc.pid, out / f"{name}-router.spy"
            spying = threading.Timer(
                profile_from_s, lambda: profile.update(hot.sample(router_worker(root), PROFILE_S, raw))
            )
            spying.start()
        try:
            return _soak_locust(s, workload, router, name, out, groups, offered, seconds)
        finally:
            if spying is not None:
                spying.join()  # py-spy ends on its own after PROFILE_S
            if timer is not None:
                timer.cancel()
                timer.join()
                if server is not None:
                    server.append(server_latency.scrape(router.url))


def _soak_locust(
    s: Settings,
    workload: Workload,
    router: Router,
    name: str,
    out: Path,
    groups: dict[str, list[int]],
    offered: int,
    seconds: float,
) -> LocustRun:
    return run_locust(
        out / name,
        router.url,
        ["GameServer"],
        locust_env(
            s,
            workload,
            {
                "SHARDLB_SHAPE": "soak",
                "SHARDLB_TARGET_WRITES": str(offered),
                "SHARDLB_DURATION": str(seconds),
            },
        ),
        s.locust_processes,
        [],
        {**groups, "router": [router.proc.pid] if router.proc else []},
        seconds + 56,
    )


READ_PROFILE_LEAD_S = 5.0  # a read mix's Locust starting and spawning its users before py-spy samples
PROFILE_S = 5.0  # py-spy's sample of a router worker in the first step of the latency curve


def router_worker(root: int) -> int:
    """One worker process of the router started as ``root`` (uvicorn's workers are spawned
    multiprocessing children; its supervisor and resource tracker only wait), else ``root``."""
    for pid in descendants(root)[1:]:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            return pid
    return root


def latency_curve(
    s: Settings,
    workload: Workload,
    cluster: LocalCluster,
    out: Path,
    redis: dict[str, list[int]],
    http: dict[str, Any],
) -> dict[str, Any]:
    """Constant-rate HTTP write steps at s.latency_shares of the ramp's sustained rate, each through
    a fresh router of s.write_workers processes: the write latency below saturation (issue 13:
    write p99 under 50 ms at 80% of the sustained maximum). Each step holds its rate for at least
    Locust's percentile window, so the percentiles read at its end cover the held rate only."""
    sustained = http.get("writes", {}).get("sustained_writes_per_s")
    if router_missing() or not sustained:
        return {"skipped": http.get("skipped", "the ramp sustained no writes")}
    # The soak shape spends its first quarter (at most 10 s) at half the rate; the rest must cover
    # the users' spawning and then Locust's whole percentile window.
    hold = locust_csv.RECENT_WINDOW_S + report.SPAWN_SETTLE_S
    seconds = float(max(s.sweep_seconds + 4, math.ceil(4 / 3 * hold)))
    soak = (seconds, s.user_rps, workload.players_per_match, 6, workload.fresh_share)
    held_from = shapes.schedule("soak", sustained, *soak)[0].until
    steps = []
    for n, share in enumerate(s.shares()):
        offered = round(share * sustained)
        stages = shapes.schedule("soak", offered, *soak)
        scrapes: list[server_latency.Buckets] = []
        # The first step's routers are profiled once its rate is held, where write CPU and latency go;
        # the step the goal is read from (80%) is left unsampled, as py-spy takes a little CPU.
        profile: dict[str, Any] | None = {} if n == 0 else None
        run = soak_run(
            s,
            workload,
            cluster,
            f"latency-{share * 100:g}",
            out,
            redis,
            offered,
            s.write_workers,
            seconds,
            server=scrapes,
            server_from_s=seconds - locust_csv.RECENT_WINDOW_S,  # about Locust's window at the end
            profile=profile,
            profile_from_s=held_from + report.SPAWN_SETTLE_S,
        )
        step = {"share": share, **report.latency_step(run, stages)}
        if profile:
            step["profile"] = profile
        users = stages[-1].users
        step["paced"] = paced_step(s, workload, cluster, f"paced-{share * 100:g}", out, users, seconds)
        if (own := server_latency.window(scrapes)) is not None:
            step["router"] = own
        router_p = step.get("router", {})
        paced = step["paced"]
        log(
            f"latency at {share:.0%}: {step['achieved']} of {step['offered']} writes/s, "
            f"p50/p95/p99 {step['p50_ms']}/{step['p95_ms']}/{step['p99_ms']} ms "
            f"(router's own {router_p.get('p50_ms')}/{router_p.get('p95_ms')}/{router_p.get('p99_ms')}), "
            f"{step['failures']} failures; light paced client "
            f"{paced.get('p50_ms')}/{paced.get('p95_ms')}/{paced.get('p99_ms')} ms"
        )
        steps.append(step)
    return {
        "sustained_writes_per_s": sustained,
        "router_workers": s.write_workers,
        "seconds": seconds,
        "held_from_s": held_from,
        "steps": steps,
    }


def paced_step(
    s: Settings,
    workload: Workload,
    cluster: LocalCluster,
    name: str,
    out: Path,
    users: int,
    seconds: float,
    matches: int = 1,
) -> dict[str, Any]:
    """The load of a latency step's Locust users (``users`` at s.user_rps requests a second, of
    ``matches`` matches each) offered by bench/pacer.py, a client that takes a fraction of Locust's
    CPU, through a fresh router of s.write_workers processes: its figures over the same window at
    the end (Locust's last RECENT_WINDOW_S seconds), the router's own over that window
    (``router``, as ``soak_run`` scrapes it), and the CPU of the router, the client and the store
    over it with the seconds each waited for a core (``cpu``), or why it could not run."""
    settle = max(0.0, seconds - locust_csv.RECENT_WINDOW_S)
    router = Router(cluster.url, free_port(22400), s.write_workers, out / f"{name}-router.log", router_env())
    scrapes: list[server_latency.Buckets] = []
    masters, replicas = node_pids(cluster)
    with router:
        assert router.proc is not None
        command = [
            *(sys.executable, "-m", "bench.pacer", "--url", router.url, "--users", str(users)),
            *("--rps", str(s.user_rps), "--seconds", str(seconds), "--settle", str(settle)),
            *("--key", WRITE_KEY, "--matches", str(matches)),
        ]
        log(f"{name}: {users} paced users through {s.write_workers} router workers")
        proc = _pacer(command, s, workload, subprocess.PIPE)
        groups = {"redis masters": masters, "redis replicas": replicas, "router": [router.proc.pid]}
        meter = CpuMeter({**groups, "client": [proc.pid]})
        try:
            time.sleep(settle)
            scrapes.append(server_latency.scrape(router.url))
            meter.start()
            stdout, stderr = proc.communicate(timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return {"skipped": f"bench.pacer did not finish within {seconds + 60:.0f} s"}
        finally:
            # The client's own exit is in the window: its last requests' answers are too.
            cpu = meter.stop() if meter.wall0 else None
            scrapes.append(server_latency.scrape(router.url))
    if proc.returncode != 0 or not stdout.strip():
        return {"skipped": f"bench.pacer exited {proc.returncode}: {stderr.strip()[-300:]}"}
    result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    if (own := server_latency.window(scrapes)) is not None:
        result["router"] = own
    if cpu is not None:
        result["cpu"] = cpu
    return {**result, "users": users, "window_s": seconds - settle}


def light_client(
    s: Settings, workload: Workload, cluster: LocalCluster, out: Path, redis: dict[str, list[int]]
) -> dict[str, Any]:
    """The router's own write maximum: bench/pacer.py's s.light_users users posting matches back to
    back (each waits for its answer, then posts again) through a fresh router of s.write_workers
    processes, with the router's, the store's and the client's CPU per player-score write metered
    over the held part, then the same client's paced users at 80% of that maximum (``at_80``); then
    both again with s.light_matches matches in each request (``batched``), as a game server that
    batches its results sends them: what a write costs the router apart from what a request does.

    Locust spends more CPU per request than the router on the same two cores, so the ramp finds
    Locust's maximum as much as the router's, and measures the router's CPU at that rate. This
    client takes a few µs per write: what is left is the router's own ceiling and its cost there,
    the figures a capacity plan for routers fed by many game servers needs."""
    if router_missing():
        return {"skipped": "no router"}
    result = _router_max(s, workload, cluster, out, redis, "light", 1, profiled=True)
    if "skipped" not in result and s.light_matches > 1:
        result["batched"] = _router_max(s, workload, cluster, out, redis, "light", s.light_matches)
    return result


def _router_max(
    s: Settings,
    workload: Workload,
    cluster: LocalCluster,
    out: Path,
    redis: dict[str, list[int]],
    name: str,
    matches: int,
    profiled: bool = False,
) -> dict[str, Any]:
    """``light_client``'s maximum: bench/pacer.py's users posting ``matches`` matches a request
    back to back through a fresh router; writes/s, latency, and the router's, the store's and the
    client's CPU per player-score write over the held part (with a py-spy profile of the router
    worker under the same load offered again when ``profiled``); then paced users at 80% of that
    rate through another fresh router (``at_80``). There are s.light_users users divided by
    ``matches``, so as many scores are in flight whatever the request's size (256 users of 10
    matches would hold more than the coalescer accepts, and be refused: back-pressure)."""
    seconds, settle = float(s.sweep_seconds + 6), 4.0
    users = max(1, s.light_users // matches)
    name = f"{name}-max" if matches == 1 else f"{name}-max-{matches}"
    router = Router(cluster.url, free_port(22400), s.write_workers, out / f"{name}-router.log", router_env())
    with router:
        assert router.proc is not None
        command = [
            *(sys.executable, "-m", "bench.pacer", "--url", router.url, "--users", str(users)),
            *("--rps", "1000", "--seconds", str(seconds), "--settle", str(settle), "--key", WRITE_KEY),
            *("--matches", str(matches)),
        ]
        log(
            f"{name}: {users} light users back to back, {matches} match(es) a request, through "
            f"{s.write_workers} router workers"
        )
        proc = _pacer(command, s, workload, subprocess.PIPE)
        time.sleep(settle)
        gc_before = server_latency.scrape_gc(router.url)
        meter = CpuMeter({**redis, "router": [router.proc.pid], "client": [proc.pid]}).start()
        time.sleep(max(1.0, seconds - settle - 0.5))
        cpu = meter.stop()
        gc_after = server_latency.scrape_gc(router.url)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            return {"skipped": "bench.pacer did not finish within 60 s of its end"}
        # py-spy takes CPU of its own: the profile comes from the same load offered again after
        # the metered window, not from inside it.
        profile = (
            _profiled_load(command, s, workload, router.proc.pid, out / f"{name}-router.spy")
            if profiled
            else None
        )
    if proc.returncode != 0 or not stdout.strip():
        return {"skipped": f"bench.pacer exited {proc.returncode}: {stderr.strip()[-300:]}"}
    got: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    window = seconds - settle  # the pacer counts the requests started after its settle time
    writes_per_s = got["scores"] / window
    used, writes = cpu["cpu_s"], writes_per_s * cpu["wall_s"]
    result: dict[str, Any] = {
        "users": users,
        "router_workers": s.write_workers,
        "matches_per_request": matches,
        "scores_per_request": matches * workload.players_per_match,
        "writes_per_s": round(writes_per_s),
        **{k: got.get(k) for k in ("requests", "failures", "p50_ms", "p95_ms", "p99_ms")},
        "cpu": cpu,
        "router_us": round(used.get("router", 0.0) / writes * 1e6, 1) if writes else None,
        "store_us": round(
            (used.get("redis masters", 0.0) + used.get("redis replicas", 0.0)) / writes * 1e6, 1
        )
        if writes
        else None,
        "client_us": round(used.get("client", 0.0) / writes * 1e6, 1) if writes else None,
        "gc": server_latency.gc_between(gc_before, gc_after),
    }
    if profile is not None:
        result["profile"] = profile
    log(
        f"{name}: {writes_per_s:,.0f} writes/s, router {result['router_us']} µs, store "
        f"{result['store_us']} µs, client {result['client_us']} µs per write, p99 {got.get('p99_ms')} ms, "
        f"{got.get('failures')} failures"
    )
    at_80 = name.replace("-max", "-80")
    scores = matches * workload.players_per_match
    # The pacer's exact retries (Workload.fresh_share) write nothing new: more users offer 80%.
    fresh = s.user_rps * scores * workload.fresh_share  # fresh writes/s a paced user offers
    users = max(1, round(0.8 * writes_per_s / fresh))
    hold = float(max(s.sweep_seconds + 4, locust_csv.RECENT_WINDOW_S + 6))
    paced = paced_step(s, workload, cluster, at_80, out, users, hold, matches)
    result["at_80"] = {
        **paced,
        "offered_writes_per_s": round(users * fresh),
        "achieved_writes_per_s": round(paced.get("scores", 0) / paced.get("window_s", 1.0)),
    }
    log(
        f"{at_80}: {users} paced users, {result['at_80']['achieved_writes_per_s']:,} of "
        f"{result['at_80']['offered_writes_per_s']:,} writes/s, p50/p95/p99 "
        f"{paced.get('p50_ms')}/{paced.get('p95_ms')}/{paced.get('p99_ms')} ms"
    )
    return result


def _pacer(command: list[str], s: Settings, workload: Workload, output: int) -> subprocess.Popen[str]:
    """bench.pacer's ``command`` started with the workload's settings in its environment, its
    output and errors to ``output`` (PIPE to read them, or DEVNULL)."""
    return subprocess.Popen(
        command,
        env={**os.environ, **locust_env(s, workload, {})},
        stdout=output,
        stderr=output,
        text=True,
        cwd=ROOT,
    )


def _profiled_load(
    command: list[str], s: Settings, workload: Workload, root: int, raw: Path
) -> dict[str, Any]:
    """One router worker sampled by py-spy for PROFILE_S while ``command`` (bench.pacer) offers
    its load again, for PROFILE_S + 2 s."""
    if hot.py_spy() is None:
        return {"skipped": "py-spy not installed (pip install py-spy)"}
    again = list(command)
    again[again.index("--seconds") + 1] = f"{PROFILE_S + 2:g}"
    again[again.index("--settle") + 1] = "0"
    load = _pacer(again, s, workload, subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        return hot.sample(router_worker(root), PROFILE_S, raw)
    finally:
        try:
            load.wait(timeout=PROFILE_S + 60)
        except subprocess.TimeoutExpired:
            load.kill()


def router_sweep(
    s: Settings,
    workload: Workload,
    cluster: LocalCluster,
    out: Path,
    redis: dict[str, list[int]],
    offered: int,
) -> list[dict[str, Any]]:
    """Short HTTP write steps at ``offered`` writes/s with 1, 2, ... router processes."""
    if router_missing():
        return []
    return [
        {
            "router_workers": workers,
            **soak(s, workload, cluster, f"sweep-router-{workers}", out, redis, offered, workers),
        }
        for workers in int_list(s.sweep_routers)
    ]


def masters_sweep(s: Settings, workload: Workload, main: LocalCluster, out: Path) -> list[dict[str, Any]]:
    """Short raw-write steps on clusters of 1, 2, ... masters (fresh, empty boards but the main one)."""
    points = []
    for masters in int_list(s.sweep_masters):
        cluster = (
            main
            if masters == main.masters
            else start_cluster(masters, s.replicas, out / f"cluster-{masters}", start=22200)
        )
        try:
            if cluster is not main:
                asyncio.run(create_board(cluster.url, workload, s.shards))
            m, r = node_pids(cluster)
            job = Job(
                "raw writes",
                cluster.url,
                workload,
                s.sweep_seconds,
                s.write_concurrency,
                s.batch_matches,
                seed=7,
            )
            phase = driver_phase(job, s.driver_processes, {"redis masters": m, "redis replicas": r})
            lat = phase["latency_ms"].get("write batch", {})
            points.append(
                {
                    "masters": masters,
                    "writes_per_s": phase["items_per_s"],
                    "p99_ms": lat.get("p99"),
                    "errors": phase["errors"],
                    "cpu": phase["cpu"],
                }
            )
        finally:
            if cluster is not main:
                cluster.down()
    return points


def raw_twin(workload: Workload) -> Workload:
    """The same players on a board of their own for the raw write phase: it starts from the state the
    HTTP ramp started from, not from a board the HTTP phases have already raised."""
    return replace(workload, board=f"{workload.board}-raw")


def journal_twin(workload: Workload) -> Workload:
    """The same players on a board of their own whose results are journaled and archived."""
    return replace(workload, board=f"{workload.board}-journal")


def durability_phases(
    s: Settings,
    workload: Workload,
    cluster: LocalCluster,
    out: Path,
    redis: dict[str, list[int]],
    offered: int,
) -> dict[str, Any]:
    """Writes with the journal and the archiver on beside the journal off, raw and over HTTP, and
    replica acknowledgement beside primary: bench/durability.py. The memory phases run first, with
    no archiver; the journaled phases each end with a wait until the archive has caught up."""
    try:
        db = ArchiveDatabase(out / "archive").up()
    except ClusterError as e:
        log(f"durability phases skipped: {e}")
        return {"skipped": str(e)}
    twin = journal_twin(workload)
    archiver = ArchiverProcess(cluster.url, db.url, out / "archiver.log")
    result: dict[str, Any] = {
        "postgres": db.describe(),
        "memory_board": workload.board,
        "journal_board": twin.board,
        "offered_writes": offered,
        "router_workers": s.write_workers,
    }
    try:
        pg = {"postgres": db.pids()}
        job = Job(
            "raw writes", cluster.url, workload, s.durability_seconds, s.write_concurrency, s.batch_matches
        )
        http = replace(s, sweep_seconds=s.durability_seconds)
        result["raw"] = {"memory": driver_phase(job, s.driver_processes, {**redis, **pg})}
        if not router_missing():
            result["http"] = {
                "memory": soak(http, workload, cluster, "durability-memory", out, {**redis, **pg}, offered,
                               s.write_workers),
            }  # fmt: skip
        archiver.start()
        groups = {**redis, "archiver": archiver.pids, **pg}
        phase = JournalPhase(cluster.url, twin.board, db, groups, s.drain_wait)
        result["raw"]["journal"] = phase.run(
            lambda: driver_phase(replace(job, workload=twin), s.driver_processes, groups)
        )
        if "http" in result:
            result["http"]["journal"] = phase.run(
                lambda: soak(http, twin, cluster, "durability-journal", out, groups, offered, s.write_workers)
            )
            result["http"]["replica"] = replica_phase(http, twin, cluster, out, groups, offered, phase)
        if archiver.exit_code() is not None:
            result["archiver_died"] = f"exit status {archiver.exit_code()}; see {out / 'archiver.log'}"
    finally:
        archiver.stop()
        db.down()
    return result


def replica_phase(
    s: Settings,
    twin: Workload,
    cluster: LocalCluster,
    out: Path,
    groups: dict[str, list[int]],
    offered: int,
    phase: JournalPhase,
) -> dict[str, Any]:
    """The journaled HTTP phase again with SHARDLB_ACK=replica; skipped, with the reason, while the
    router has no such setting (it ignores SHARDLB_* variables it does not know)."""
    if not router_knows("ack"):
        reason = (
            "the router has no SHARDLB_ACK setting yet (router/settings.py): "
            "replica acknowledgement not measured"
        )
        log(reason)
        return {"skipped": reason}
    return phase.run(
        lambda: soak(s, twin, cluster, "durability-replica", out, groups, offered, s.write_workers,
                     {"SHARDLB_ACK": "replica"})
    )  # fmt: skip


def wait_for_quiet(seconds: float) -> float:
    """On a shared machine, wait (up to ``seconds``) until the machine as a whole uses under
    QUIET_CORES for 5 s, so the contenders get the same machine. Returns the load last seen."""
    deadline = time.monotonic() + seconds
    while True:
        before = machine_cpu_seconds()
        time.sleep(5)
        load = (machine_cpu_seconds() - before) / 5
        if load < QUIET_CORES or time.monotonic() >= deadline:
            return load
        log(f"machine busy ({load:.2f} cores used by others); waiting for it to quieten")


def new_summary(s: Settings, workload: Workload) -> dict[str, Any]:
    """What summary.json says before anything is measured: the machine, the knobs and the goal."""
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "settings": asdict(s),
        "workload": {
            "players_per_match": workload.players_per_match,
            "skew": workload.skew,
            "points": asdict(workload.points),
            "retry_share": workload.retry_share,
            "read_mix": dict(workload.read_mix),
        },
        "goal": {"writes_per_s": GOAL_WRITES, "router_over_raw": GOAL_RATIO},
    }


def preload_all(
    s: Settings, workload: Workload, cluster: LocalCluster
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same players into the board, its journaled twin and the textbook set, and meanwhile into
    PostgreSQL (in another process): (the population's figures, PostgreSQL's load or why it was
    skipped)."""
    twin, raw_board = journal_twin(workload), raw_twin(workload)
    asyncio.run(create_board(cluster.url, workload, s.shards))
    asyncio.run(create_board(cluster.url, twin, s.shards, durability="journal"))
    asyncio.run(create_board(cluster.url, raw_board, s.shards))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        pg = pool.apply_async(pg_preload, (s.pg_dsn, workload, cluster.url))
        population = preload(cluster.url, workload, s.driver_processes)
        population["journal_board_load_s"] = round(
            population_load(cluster.url, twin, 0, twin.players, s.driver_processes), 1
        )
        population["raw_board_load_s"] = round(
            population_load(cluster.url, raw_board, 0, raw_board.players, s.driver_processes), 1
        )
        pg_load: dict[str, Any] = pg.get(timeout=600)
    return population, pg_load


def driver_phases(
    s: Settings,
    workload: Workload,
    cluster: LocalCluster,
    redis: dict[str, list[int]],
    pg_load: dict[str, Any],
    http_scores: int = 0,
) -> dict[str, Any]:
    """The raw limit, the textbook design and PostgreSQL, each writes then reads, with no HTTP.

    The raw writes go to a twin of the board loaded with the same players, and stop at the number
    of player-scores the HTTP ramp wrote (``http_scores``, when it ran): the same writes onto the
    same state. A ``best`` board's write costs less once its players' bests are high (fewer results
    beat them), so raw writes onto the board the HTTP phases had already raised would cost the
    store less for reasons that are not the library's."""
    raw = Job(
        "raw writes",
        cluster.url,
        raw_twin(workload),
        s.raw_seconds,
        s.write_concurrency,
        s.batch_matches,
        s.pg_dsn,
        items=http_scores,
    )
    peer = replace(raw, workload=workload, seconds=s.peer_seconds, items=0)

    def run(job: Job, kind: str, concurrency: int, groups: dict[str, list[int]]) -> dict[str, Any]:
        return driver_phase(replace(job, kind=kind, concurrency=concurrency), s.driver_processes, groups)

    phases: dict[str, Any] = {
        "raw": {
            "writes": run(raw, "raw writes", s.write_concurrency, redis),
            "reads": run(replace(raw, workload=workload, items=0), "raw reads", s.read_concurrency, redis),
        },
        "textbook": {
            "writes": run(peer, "textbook writes", 64, redis),
            "reads": run(peer, "textbook reads", s.read_concurrency, redis),
        },
    }
    if "skipped" in pg_load:
        phases["postgres"] = {"skipped": pg_load["skipped"]}
        log(f"PostgreSQL skipped: {pg_load['skipped']}")
    else:
        phases["postgres"] = {
            "writes": run(peer, "postgres writes", 16, {"postgres": postgres_pids()}),
            "reads": run(peer, "postgres reads", 8, {"postgres": postgres_pids()}),
        }
    return phases


def sweeps(
    s: Settings,
    workload: Workload,
    cluster: LocalCluster,
    out: Path,
    redis: dict[str, list[int]],
    http: dict[str, Any],
) -> dict[str, Any]:
    # A little above what the ramp sustained: enough to saturate, not so much that the steps
    # measure overload collapse (a queue of a thousand users) instead of capacity.
    sustained = http.get("writes", {}).get("sustained_writes_per_s", 0)
    offered = round(1.25 * sustained) if sustained else s.target_writes
    return {
        "routers": router_sweep(s, workload, cluster, out, redis, offered),
        "router_offered_writes": offered,
        "masters": masters_sweep(s, workload, cluster, out),
    }


def write_results(summary: dict[str, Any], out: Path) -> None:
    """summary.json, summary.md and the plots in ``out``, copied to bench/results/latest/; the
    clusters' data removed; summary.md printed."""
    report.finish(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (out / "summary.md").write_text(report.markdown(summary, out.name))
    report.plots(summary, out)
    publish(out, ["summary.md", "summary.json", *(png.name for png in out.glob("*.png"))])
    shutil.rmtree(out / "cluster", ignore_errors=True)
    for extra in out.glob("cluster-*"):
        shutil.rmtree(extra, ignore_errors=True)
    print((out / "summary.md").read_text())


def main(argv: list[str] | None = None) -> int:
    s = Settings.from_env()
    workload = replace(Workload.from_env(), players=s.players)
    out = run_dir(time.strftime("%Y%m%d-%H%M%S"))
    log(f"results in {out}")
    summary = new_summary(s, workload)
    if s.quiet_wait > 0:
        summary["load_before_start_cores"] = round(wait_for_quiet(s.quiet_wait), 2)
    t_start = time.monotonic()
    cluster = start_cluster(s.masters, s.replicas, out / "cluster", start=22100)
    try:
        masters, replicas = node_pids(cluster)
        redis = {"redis masters": masters, "redis replicas": replicas}
        log(f"cluster up: {cluster.url}; preloading {s.players} players")
        summary["population"], summary["postgres_load"] = preload_all(s, workload, cluster)
        log(f"preloaded: {summary['population']}, postgres {summary['postgres_load']}")
        summary["http"] = http_phases(s, workload, cluster, out, redis)
        summary["latency_curve"] = latency_curve(s, workload, cluster, out, redis, summary["http"])
        summary["light_client"] = light_client(s, workload, cluster, out, redis)
        ramp = summary["http"].get("writes", {})
        summary.update(
            driver_phases(
                s, workload, cluster, redis, summary["postgres_load"], ramp.get("scores_written", 0)
            )
        )
        summary["hot"] = hot.run(cluster.url, workload, s.masters, redis, out, s.driver_processes)
        if "skipped" not in summary["http"]:
            summary["http"]["reads_planned"] = planned_reads(s, workload, cluster, out, redis, summary["hot"])
            summary["http"]["reads_band"] = band_reads(s, workload, cluster, out, redis, summary["hot"])
            sustained = summary["http"].get("writes", {}).get("sustained_writes_per_s")
            summary["http"]["writes_band"] = band_writes(s, workload, cluster, out, redis, sustained)
        summary["sweeps"] = sweeps(s, workload, cluster, out, redis, summary["http"])
        summary["durability"] = durability_phases(
            s, workload, cluster, out, redis, summary["sweeps"]["router_offered_writes"]
        )
        log("journal memory per entry and per result")
        summary["journal_memory"] = asyncio.run(journal.measure(cluster.url))
    finally:
        cluster.down()
    summary["seconds"] = round(time.monotonic() - t_start, 1)
    write_results(summary, out)
    log(f"done in {summary['seconds']:.0f} s: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
