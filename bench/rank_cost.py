"""Redis's cost per exact "my rank" on a hash board of one shard per master, beside the textbook's.

    python -m bench.rank_cost --against ../other      # another checkout's library in the same rounds
    python -m bench.rank_cost --url redis://...       # a cluster already up (loaded unless it holds them)

Issue 13 asks the store's CPU per "my rank" to be at most 2x the textbook's (ZSCORE, ZREVRANK and
ZCARD in one pipeline on one sorted set). `make bench` measures it over HTTP, one run a VM
(bench/hot.py); this measures the store's side alone, through the library, with the sides taking
turns on one cluster. It starts its own cluster (SHARDLB_BENCH_MASTERS masters, 3, no replicas:
what a read costs the masters), loads a hash board of one shard per master and the textbook set with
the same ``--players`` (bench/population.py), then in each round runs each side in turn, the order
reversed every other round: ``this`` (this checkout's library), ``other`` (with ``--against DIR``:
that checkout's library) and ``textbook``. Each side is a fresh bench/rank_reader.py process run with
its checkout first on PYTHONPATH (and that checkout's .venv when it has one): ``--reads`` random
players, ``--readers`` at a time, as a router's concurrent requests are (their rounds are then
shared: fanout.SharedRounds). A round 0 of each side is not counted.

Per side and round, over the masters, in the reads' window only: CPU per read (INFO cpu, the
servers' own used_cpu_user + used_cpu_sys, so no reader's CPU is in it) and INFO commandstats' calls
and µs per read, the steadier figure on a shared machine (Redis's time inside its commands; the
sockets, the parsing and the replies are in the CPU figure only). Prints the medians, each side's
ratio to the textbook and each round's; writes bench/results/<time>-rank-cost/rank_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis

from bench import peers, population
from bench.commandstats import delta, nodes, snapshot
from bench.harness import env_int, log, run_dir
from bench.services import ROOT
from bench.testbed import create_board, start_cluster
from bench.workload import Workload

READER = Path(__file__).with_name("rank_reader.py")
READS = ("rank", "around", "friends", "page", "top")  # rank_reader.py's


def masters_cpu(url: str) -> float:
    """Seconds of CPU the cluster's masters have used (INFO cpu), summed."""
    total = 0.0
    for host, port, password in nodes(url):
        client = redis.Redis(host=host, port=port, password=password, socket_timeout=5)
        try:
            if client.info("replication")["role"] == "master":
                cpu = client.info("cpu")
                total += float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
        finally:
            client.close()
    return total


def side_run(
    kind: str,
    tree: Path,
    url: str,
    name: str,
    players: int,
    reads: int,
    readers: int,
    seed: int,
    what: str = "rank",
) -> dict[str, Any]:
    """One side's reads of kind ``what``, metered from the reader's "ready" to its "done"."""
    python = tree / ".venv" / "bin" / "python"
    argv = [str(python if python.exists() else sys.executable), str(READER), kind, url, name]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    numbers = [str(n) for n in (players, reads, readers, seed)] + ([what] if what != "rank" else [])
    proc = subprocess.Popen(
        [*argv, *numbers], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{kind} reader of {tree} did not start")
        before, cpu0 = snapshot(url), masters_cpu(url)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        done = proc.stdout.readline().split()
        cpu1, after = masters_cpu(url), snapshot(url)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    if not done or done[0] != "done":
        raise RuntimeError(f"{kind} reader of {tree} failed (exit {proc.returncode})")
    commands = {c: v for c, v in delta(before, after).items() if c != "info"}
    return {
        "seconds": float(done[1]),
        "cpu_us": round((cpu1 - cpu0) / reads * 1e6, 2),
        "usec": round(sum(v["usec"] for v in commands.values()) / reads, 2),
        "per_read": {
            c: (round(v["calls"] / reads, 3), round(v["usec"] / reads, 2)) for c, v in commands.items()
        },
    }


async def _create(url: str, workload: Workload, masters: int) -> None:
    await create_board(url, workload, masters)


def load(url: str, workload: Workload, masters: int, key: str) -> None:
    """The board and the textbook set, unless the set already holds the players (a cluster given)."""
    client = redis.RedisCluster.from_url(url.split(",")[0])
    try:
        if client.zcard(key) == workload.players:
            return
    finally:
        client.close()
    asyncio.run(_create(url, workload, masters))
    population.load_parallel(url, workload, 0, workload.players, 2)
    population.load_parallel(url, workload, 0, workload.players, 2, key)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", type=Path, help="another checkout, whose library reads in the same rounds")
    p.add_argument("--url", help="a cluster already up (the board and the set are loaded unless there)")
    p.add_argument("--players", type=int, default=1_000_000)
    p.add_argument("--reads", type=int, default=20_000, help="reads per side and round")
    p.add_argument("--readers", type=int, default=16, help="reads in flight (a router's read gate: 16)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--read",
        default="rank",
        help="the kinds of read, comma-separated, each measured in turn: " + ",".join(READS),
    )
    args = p.parse_args(argv)
    reads = args.read.split(",")
    if not set(reads) <= set(READS):
        p.error(f"--read: one or more of {','.join(READS)}")
    masters = env_int("SHARDLB_BENCH_MASTERS", 3)
    workload = Workload(board=f"rank-cost-s{masters}", players=args.players)
    key = peers.textbook_key(workload.board)
    sides = {"this": ("library", ROOT, workload.board), "textbook": ("textbook", ROOT, key)}
    if args.against:
        sides["other"] = ("library", args.against.resolve(), workload.board)
    out = run_dir(time.strftime("%Y%m%d-%H%M%S") + "-rank-cost")
    cluster = None if args.url else start_cluster(masters, 0, out / "cluster", start=22100)
    url = args.url if cluster is None else cluster.url
    rounds: list[dict[str, Any]] = []
    try:
        began = time.monotonic()
        load(url, workload, masters, key)
        took = time.monotonic() - began
        log(f"{workload.board}: {masters} shards and {key}, {args.players:,} players ({took:.0f} s)")
        for n in range(args.rounds + 1):
            for what in reads:
                for side in list(sides) if n % 2 else list(sides)[::-1]:
                    kind, tree, name = sides[side]
                    got = side_run(kind, tree, url, name, args.players, args.reads, args.readers, n, what)
                    rounds.append({"round": n, "read": what, "side": side, **got})
                    log(
                        f"round {n} {what} {side}: {got['cpu_us']} µs CPU, "
                        f"{got['usec']} µs in commands per read"
                    )
    finally:
        if cluster is not None:
            cluster.down()
            shutil.rmtree(out / "cluster", ignore_errors=True)
    counted = [r for r in rounds if r["round"] > 0]
    summary: dict[str, dict[str, Any]] = {}
    print(f"\nmedians of {args.rounds} rounds of {args.reads:,} reads, {args.readers} in flight:")
    for what in reads:
        summary[what] = {}
        for side in sides:
            mine = [r for r in counted if r["side"] == side and r["read"] == what]
            summary[what][side] = {
                "cpu_us": statistics.median(r["cpu_us"] for r in mine),
                "usec": statistics.median(r["usec"] for r in mine),
                "per_read": mine[-1]["per_read"],
            }
        book = summary[what]["textbook"]
        print(f" {what}:")
        for side, s in summary[what].items():
            ratio = f" = {s['cpu_us'] / book['cpu_us']:.2f}x / {s['usec'] / book['usec']:.2f}x the textbook's"
            print(f"  {side}: {s['cpu_us']} µs CPU, {s['usec']} µs in commands per read{ratio}")
            per_read = sorted(s["per_read"].items())
            print("    " + ", ".join(f"{c} {calls} x {us} µs" for c, (calls, us) in per_read))
        for n in range(1, args.rounds + 1):
            row = {r["side"]: r for r in counted if r["round"] == n and r["read"] == what}
            print(
                f"  round {n}: "
                + ", ".join(
                    f"{side} {row[side]['cpu_us'] / row['textbook']['cpu_us']:.2f}x"
                    f" / {row[side]['usec'] / row['textbook']['usec']:.2f}x"
                    for side in sides
                )
            )
    result = {
        "players": args.players,
        "reads": args.reads,
        "readers": args.readers,
        "summary": summary if args.read != "rank" else summary["rank"],
        "rounds": rounds,
    }
    (out / "rank_cost.json").write_text(json.dumps(result, indent=1))
    log(f"written to {out / 'rank_cost.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
