"""`make bench`'s HTTP read mix through this checkout's router beside another checkout's, on one cluster.

    python -m bench.versus_reads ../other          # a checkout with its own .venv (`make install` there)
    make bench-versus-reads AGAINST=3781e51        # the same against a clone of that revision

`make bench`'s read mix on the board of one shard per master (``bench-s3``) moves with the VM: 2,331
reads/s on the code of 3781e51, 1,578 and 1,660 on the code of 2026-12-05 evening, on other VMs. Here
both codes take turns on one machine, one cluster (SHARDLB_BENCH_MASTERS x SHARDLB_BENCH_REPLICAS,
3 x 1) and one board, loaded once by this checkout with the same players as `make bench`
(SHARDLB_BENCH_PLAYERS, 1,000,000; bench/hot.py ``prepare``). Each round starts a router of
SHARDLB_BENCH_ROUTER_WORKERS processes (2) from each tree in turn, the order swapped every round,
each run by its tree's own .venv with its own code first on PYTHONPATH and the same settings
(bench/run.py ``router_env``), and drives it with bench/run.py's ``read_mix`` (this checkout's
locustfile for both: SHARDLB_BENCH_READ_USERS "Player" users, 40, for SHARDLB_BENCH_READ_SECONDS,
15), after a round 0 of WARMUP_S a side that is not counted. Measured per round, as `make bench`
measures its mixes: reads/s that succeeded, failures, store CPU per read (masters and replicas,
/proc) and the masters' alone, router CPU per read, each kind of read's rate and p99, the commands
the cluster ran (INFO commandstats), and the cores that processes outside the bench used meanwhile
(``other_cores``: a round is only as good as the machine was quiet; SHARDLB_BENCH_QUIET_WAIT waits
for a quiet machine before the start, as in `make bench`).

Prints each side's medians over the rounds and their ratio, each round's own ratio of reads/s and of
store CPU per read (their spread is the machine's), then the commands per read of each side (all
rounds together); everything goes to bench/results/<time>-versus-reads/versus_reads.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench import hot, report
from bench.commandstats import profile_lines
from bench.harness import log, run_dir
from bench.run import Settings, read_mix, router_env, wait_for_quiet
from bench.services import ROOT, Router, free_port
from bench.testbed import node_pids, start_cluster
from bench.workload import Workload
from shardlb.cluster import LocalCluster

SIDES = ("this", "other")
WARMUP_S = 5.0  # each side's mix of round 0, which is not counted
# Figures of a round that are not medians of the table.
_NOT_FIGURES = ("round", "side", "commands", "requests")


def figures(reads: dict[str, Any]) -> dict[str, Any]:
    """One read mix (``report.http_reads``) as a round's figures: per read (every request, as
    `make bench` counts its store CPU per mix read), and each kind of read's rate and p99."""
    count, cpu, wall = reads["requests"], reads["cpu"]["cpu_s"], reads["cpu"]["wall_s"]
    per = lambda name: round(cpu[name] / count * 1e6, 1) if name in cpu and count else None  # noqa: E731
    out: dict[str, Any] = {
        "reads_per_s": reads["reads_per_s"],
        "failures": reads["failures"],
        "store_us_per_read": report.server_us(reads, count),
        "masters_us_per_read": per("redis masters"),
        "router_us_per_read": per("router"),
        "locust_cpu_bound": reads["locust_cpu_bound"],
        # Cores that processes outside the bench used, and that the hypervisor gave other guests:
        # near 0 on a quiet machine; a round where they are not says little.
        "other_cores": round(reads["cpu"]["other_cpu_s"] / wall, 2) if wall else None,
        "stolen_cores": round(reads["cpu"]["steal_cpu_s"] / wall, 2) if wall else None,
    }
    for name, e in reads["endpoints"].items():
        label = "all reads" if name == "Aggregated" else name
        out[f"{label}: reads/s"] = e["rps"]
        out[f"{label}: p99 ms"] = e["p99"]
    return out


def medians(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each side's median of every numeric figure over its rounds (a figure some round lacks: the
    median of the rounds that have it)."""
    out: dict[str, dict[str, float]] = {}
    for side in dict.fromkeys(r["side"] for r in rounds):
        mine = [r for r in rounds if r["side"] == side]
        names = dict.fromkeys(k for r in mine for k in r if k not in _NOT_FIGURES)
        out[side] = {}
        for name in names:
            values = [r[name] for r in mine if _number(r.get(name))]
            if values:
                out[side][name] = statistics.median(values)
    return out


def paired(rounds: list[dict[str, Any]], name: str, names: tuple[str, str] = SIDES) -> list[float]:
    """Each round's own ratio ``a / b`` of figure ``name``: the two sides of a round ran a minute
    apart, so the spread of these says how much the machine moved under the medians' ratio."""
    out = []
    for n in dict.fromkeys(r["round"] for r in rounds):
        got = {r["side"]: r.get(name) for r in rounds if r["round"] == n}
        a, b = got.get(names[0]), got.get(names[1])
        if _number(a) and _number(b) and b:
            out.append(round(a / b, 3))
    return out


def _number(value: object) -> bool:
    """A figure to take the median of: a number, not a flag, not NaN (Locust's "N/A")."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def table(summary: dict[str, dict[str, float]], names: tuple[str, str] = SIDES) -> list[str]:
    """Markdown: one row per figure, each side's median and ``a / b``."""
    a, b = names
    lines = [f"| median over the rounds | {a} | {b} | {a} / {b} |", "|---|---:|---:|---:|"]
    for name in dict.fromkeys([*summary.get(a, {}), *summary.get(b, {})]):
        x, y = summary.get(a, {}).get(name), summary.get(b, {}).get(name)
        ratio = f"{x / y:.3f}" if x is not None and y else "-"
        cells = ["-" if v is None else f"{v:,.1f}" for v in (x, y)]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {ratio} |")
    return lines


def _round(
    side: str,
    tree: Path,
    n: int,
    s: Settings,
    board: Workload,
    cluster: LocalCluster,
    redis: dict[str, list[int]],
    out: Path,
) -> dict[str, Any]:
    log_path = out / f"{side}-router.log"
    with Router(cluster.url, free_port(22400), s.router_workers, log_path, router_env(), tree=tree) as router:
        groups = {**redis, "router": [router.proc.pid] if router.proc else []}
        reads = read_mix(s, board, router.url, out / f"round{n}-{side}", groups, cluster.url)
    got = {"round": n, "side": side, "requests": reads["requests"], **figures(reads)}
    got["commands"] = reads["cpu"].get("commands", {})
    log(
        f"round {n}, {side}: {got['reads_per_s']:,.0f} reads/s, {got['failures']} failures, store "
        f"{got['store_us_per_read']} µs, router {got['router_us_per_read']} µs per read; "
        f"{got['other_cores']} cores used by others"
    )
    return got


def _commands(rounds: list[dict[str, Any]], side: str) -> tuple[dict[str, dict[str, int]], int]:
    """A side's commands over all its rounds, summed, and its requests."""
    total: dict[str, dict[str, int]] = {}
    for r in (r for r in rounds if r["side"] == side):
        for command, v in r["commands"].items():
            t = total.setdefault(command, {"calls": 0, "usec": 0})
            t["calls"] += v["calls"]
            t["usec"] += v["usec"]
    return total, sum(r["requests"] for r in rounds if r["side"] == side)


def _commit(tree: Path) -> str:
    git = ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"]
    done = subprocess.run(git, capture_output=True, text=True, check=False)
    return done.stdout.strip() or "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("other", type=Path, help="the other checkout, with its own .venv (`make install` there)")
    p.add_argument("--rounds", type=int, default=4, help="rounds (each: one mix per side; default 4)")
    args = p.parse_args(argv)
    other = args.other.resolve()
    if not (other / "router" / "server.py").exists() or not (other / ".venv" / "bin" / "python").exists():
        p.error(f"{other} needs router/server.py and its own .venv: run `make install` there")
    if args.rounds < 1:
        p.error("need --rounds >= 1")
    s = Settings.from_env()
    trees = {"this": ROOT, "other": other}
    players = replace(Workload.from_env(), players=s.players)
    board = hot.hot_board_workload(players, s.masters)  # bench-s3, as `make bench` names it
    if s.quiet_wait > 0:  # SHARDLB_BENCH_QUIET_WAIT, as `make bench`
        log(f"machine load before the start: {wait_for_quiet(s.quiet_wait):.2f} cores")
    out = run_dir(time.strftime("%Y%m%d-%H%M%S") + "-versus-reads")
    log(f"results in {out}; this {_commit(ROOT)}, other {_commit(other)} ({other})")
    cluster = start_cluster(s.masters, s.replicas, out / "cluster", start=22100)
    rounds: list[dict[str, Any]] = []
    warmup: list[dict[str, Any]] = []
    try:
        masters, replicas = node_pids(cluster)
        redis = {"redis masters": masters, "redis replicas": replicas}
        began = time.monotonic()
        hot.prepare(cluster.url, players, s.masters, s.driver_processes)
        load_s = round(time.monotonic() - began, 1)
        log(f"{board.board}: {s.masters} shards, {s.players:,} players loaded in {load_s} s")
        # Round 0, each side's short mix, not counted: the first reads after the load find the
        # replicas still taking it, the new sorted sets still rehashing, the machine's caches cold.
        warm = replace(s, read_seconds=min(s.read_seconds, WARMUP_S))
        warmup = [_round(side, trees[side], 0, warm, board, cluster, redis, out) for side in SIDES]
        for n in range(1, args.rounds + 1):
            for side in SIDES if n % 2 else SIDES[::-1]:
                rounds.append(_round(side, trees[side], n, s, board, cluster, redis, out))
    finally:
        cluster.down()
        shutil.rmtree(out / "cluster", ignore_errors=True)
    summary = medians(rounds)
    result = {
        "trees": {side: {"path": str(tree), "commit": _commit(tree)} for side, tree in trees.items()},
        "board": board.board,
        "players": s.players,
        "load_s": load_s,
        "settings": asdict(s),
        "medians": summary,
        "warmup": warmup,
        "paired_reads_per_s": paired(rounds, "reads_per_s"),
        "rounds": rounds,
    }
    (out / "versus_reads.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(table(summary)))
    for name in ("reads_per_s", "store_us_per_read"):
        ratios = paired(rounds, name)
        print(f"\n{name}, this / other in each round: {', '.join(map(str, ratios))}", end="")
    print("\n")
    columns = [(side, *_commands(rounds, side), summary[side].get("store_us_per_read")) for side in SIDES]
    print("\n".join(profile_lines(columns)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
