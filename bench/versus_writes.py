"""Score writes through this checkout's router beside another checkout's, on one cluster.

    python -m bench.versus_writes ../other-checkout          # e.g. a git worktree of an earlier commit
    python -m bench.versus_writes ../other --matches 10      # 10 matches (100 scores) a request

`make bench`'s write figures move with the VM (a run on a slower VM gave the raw library 78,486
writes/s where the one before gave 91,510), so what one commit's code costs the router on the write
path is best seen with both routers taking turns on one machine. The two routers run from this
virtualenv, each with its own tree first on ``PYTHONPATH`` (the other tree needs no ``make install``,
only the same dependencies), against one local cluster of 3 masters x 1 replica started here, and a
``durability: memory`` board (no archiver runs, so a journaled board's journal would fill). Each
round starts one router process per side in turn, the order swapped every round; bench/pacer.py's
light client posts matches back to back on ``--users`` connections (divided by ``--matches``, as
`make bench`'s router maximum does), and the router's CPU (/proc) is read over the middle of the
run. Prints each round, then each side's median writes/s and router CPU µs per player-score write;
everything measured goes to bench/results/versus-writes-<time>/versus_writes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.harness import log
from bench.procs import cpu_seconds
from bench.services import ROOT, free_port

ADMIN, WRITE = "versus-writes-admin-0000", "versus-writes-write-0000"
BOARD = "bench"  # bench/workload.py's board, which the pacer posts to


def per_write_us(cpu_s: float, scores: int, window_s: float, metered_s: float) -> float:
    """Router CPU µs per player-score write: ``cpu_s`` seconds metered over ``metered_s``, while
    the pacer counted ``scores`` in its ``window_s`` (the rate is what the two windows share)."""
    if scores <= 0 or window_s <= 0 or metered_s <= 0:
        raise ValueError("no writes were counted")
    return cpu_s / (scores / window_s * metered_s) * 1e6


def medians(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each side's median writes/s and router µs per write over the rounds."""
    sides: dict[str, list[dict[str, Any]]] = {}
    for r in rounds:
        sides.setdefault(r["side"], []).append(r)
    return {
        side: {
            "writes_per_s": statistics.median(r["writes_per_s"] for r in rs),
            "router_us_per_write": statistics.median(r["router_us_per_write"] for r in rs),
        }
        for side, rs in sides.items()
    }


def _router(tree: Path, port: int, redis_url: str, log_path: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "SHARDLB_REDIS_URL": redis_url,
        "SHARDLB_ADMIN_KEYS": ADMIN,
        "SHARDLB_WRITE_KEYS": WRITE,
        "SHARDLB_READ_RATE": "0",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.server", "--workers", "1", "--port", str(port)],
        cwd=tree,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log_path.open("w"),
    )
    for _ in range(200):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the router of {tree} did not start: {log_path}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _round(side: str, tree: Path, args: argparse.Namespace, redis_url: str, out: Path) -> dict[str, Any]:
    port = free_port(23300)
    router = _router(tree, port, redis_url, out / f"{side}-router.log")
    try:
        users = max(1, args.users // args.matches)
        pacer = subprocess.Popen(
            [
                *(sys.executable, "-m", "bench.pacer", "--url", f"http://127.0.0.1:{port}"),
                *("--users", str(users), "--rps", "1000", "--seconds", str(args.seconds)),
                *("--settle", str(args.settle), "--key", WRITE, "--matches", str(args.matches)),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(args.settle)
        before, t0 = cpu_seconds(router.pid), time.monotonic()
        time.sleep(args.seconds - args.settle - 1)
        after, t1 = cpu_seconds(router.pid), time.monotonic()
        stdout, _ = pacer.communicate(timeout=120)
    finally:
        _stop(router)
    if before is None or after is None or pacer.returncode != 0:
        raise RuntimeError(f"{side}: the router or the pacer stopped (pacer exit {pacer.returncode})")
    got = json.loads(stdout.strip().splitlines()[-1])
    window = args.seconds - args.settle
    return {
        "side": side,
        "writes_per_s": round(got["scores"] / window),
        "router_us_per_write": round(per_write_us(after - before, got["scores"], window, t1 - t0), 2),
        "failures": got.get("failures", 0),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("other", type=Path, help="the other checkout (a git worktree of another commit)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seconds", type=float, default=14.0, help="each side's run, settle included")
    p.add_argument("--settle", type=float, default=4.0)
    p.add_argument("--users", type=int, default=256, help="connections back to back (divided by --matches)")
    p.add_argument("--matches", type=int, default=1, help="matches (of 10 players) a request")
    args = p.parse_args(argv)
    if not (args.other / "router" / "server.py").exists():
        p.error(f"{args.other} holds no router/server.py")
    if args.rounds < 1 or args.matches < 1 or not 0 < args.settle < args.seconds - 1:
        p.error("need --rounds >= 1, --matches >= 1 and 0 < --settle < --seconds - 1")
    out = ROOT / "bench" / "results" / f"versus-writes-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True)
    cluster_dir = str(out / "cluster")
    shardlb = [sys.executable, "-m", "shardlb", "cluster"]
    up = subprocess.run(
        [*shardlb, "up", "--port", str(free_port(23100)), "--dir", cluster_dir],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    found = re.search(r"redis://\S+", up.stdout + up.stderr)
    if up.returncode != 0 or found is None:
        raise SystemExit(f"cluster up failed: {up.stderr[-500:]}")
    redis_url = found[0].rstrip(".,")
    trees = {"this": ROOT, "other": args.other.resolve()}
    rounds: list[dict[str, Any]] = []
    try:
        port = free_port(23300)
        maker = _router(ROOT, port, redis_url, out / "create-router.log")
        try:
            board = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/boards/{BOARD}",
                data=b'{"durability": "memory"}',
                headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
                method="PUT",
            )
            urllib.request.urlopen(board, timeout=30).close()
        finally:
            _stop(maker)
        for i in range(args.rounds):
            for side in list(trees) if i % 2 == 0 else list(trees)[::-1]:
                rounds.append({"round": i + 1, **_round(side, trees[side], args, redis_url, out)})
                r = rounds[-1]
                log(
                    f"round {r['round']}, {side}: {r['writes_per_s']} writes/s, "
                    f"{r['router_us_per_write']} µs of router CPU per write, {r['failures']} failures"
                )
    finally:
        subprocess.run([*shardlb, "down", "--dir", cluster_dir], cwd=ROOT, capture_output=True, timeout=120)
    summary = medians(rounds)
    (out / "versus_writes.json").write_text(
        json.dumps(
            {"other": str(trees["other"]), "matches": args.matches, "rounds": rounds, **summary}, indent=2
        )
    )
    for side, m in summary.items():
        us = m["router_us_per_write"]
        print(f"{side}: median {m['writes_per_s']:.0f} writes/s, {us:.2f} µs of router CPU per write")
    return 0


if __name__ == "__main__":
    sys.exit(main())
