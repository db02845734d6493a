"""Hot reads of this checkout's router beside another checkout's, on the same machine and data.

    python -m bench.versus ../other-checkout      # e.g. a clone of an earlier commit, `make install` done

What one commit's code gains over another's is easiest to see with both answering side by side:
runs minutes apart on a shared VM differ by up to 40% (README, "Performance"). Each side gets its
own local cluster (3 masters x 1 replica, started by its own ``shardlb cluster up``), its own
router process (``router.server --workers 1``, from its own virtualenv and code), and the same
players, posted through the HTTP API that both speak (api.md): a board of 16 hash shards and one of
3 (SHARDLB_VERSUS_PLAYERS players each, points drawn from one seeded Pareto distribution). Then wrk
(bench/hot.py's script: one thread, 32 connections, a random player per request) takes each target
on both sides in turn, SHARDLB_VERSUS_ROUNDS rounds of SHARDLB_VERSUS_SECONDS, the order of the
sides swapped every round, and the router's CPU per request is read from /proc around each run.

Prints one line per target: the median requests/s and router CPU µs per request of each side, and
their ratio; everything measured goes to bench/results/versus-<time>/versus.json.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import env_int, log
from bench.hot import WRK_SCRIPT, run_wrk
from bench.procs import cpu_seconds
from bench.services import ROOT, free_port

KEYS = {"SHARDLB_ADMIN_KEYS": "versus-admin", "SHARDLB_WRITE_KEYS": "versus-write", "SHARDLB_READ_RATE": "0"}
BOARDS = {"v16": 16, "v3": 3}
TARGETS = (
    ("/healthz", "/healthz"),
    ("top-100 (cached), 16 shards", "/v1/boards/v16/top"),
    ("my rank, 16 shards", "/v1/boards/v16/players/{player}"),
    ("my rank, 3 shards", "/v1/boards/v3/players/{player}"),
    ("around me, 16 shards", "/v1/boards/v16/players/{player}/around"),
)
CONNECTIONS = 32
NODES = 6  # 3 masters x 1 replica


@dataclass
class Side:
    name: str
    root: Path
    base: str = ""
    router: subprocess.Popen[bytes] | None = None

    @property
    def python(self) -> str:
        return str(self.root / ".venv" / "bin" / "python")

    @property
    def cluster_dir(self) -> str:
        return str(self.root / ".shardlb" / "versus-cluster")

    def shardlb(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.python, "-m", "shardlb", *args], cwd=self.root, capture_output=True, text=True, timeout=180
        )


def request(method: str, url: str, body: Any = None, key: str = "versus-admin") -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=60) as r:
        return r.status, r.read()


def points(players: int, seed: int = 42) -> list[int]:
    """The same points for both sides: a long-tailed distribution, as a game's scores are."""
    rng = random.Random(seed)
    return [int(rng.paretovariate(1.2) * 100) % 2_000_000 for _ in range(players)]


def free_block(start: int) -> int:
    """A first port from which NODES consecutive ports, and their cluster bus ports, are free."""
    port = start
    while True:
        port = free_port(port)
        wanted = [*range(port, port + NODES), *range(port + 10000, port + 10000 + NODES)]
        if all(_free(p) for p in wanted):
            return port
        port += NODES


def _free(port: int) -> bool:
    try:
        return free_port(port, port) == port
    except RuntimeError:
        return False


def start(side: Side, port: int, players: int) -> None:
    side.shardlb("cluster", "down", "--dir", side.cluster_dir)
    up = side.shardlb("cluster", "up", "--port", str(port), "--dir", side.cluster_dir)
    found = re.search(r"redis://\S+", up.stdout + up.stderr)
    if up.returncode != 0 or found is None:
        raise RuntimeError(f"{side.name}: cluster up failed: {up.stderr[-500:]}")
    http = free_port(port + 200)
    side.base = f"http://127.0.0.1:{http}"
    log_file = (side.root / ".shardlb" / "versus-router.log").open("w")
    side.router = subprocess.Popen(
        [side.python, "-m", "router.server", "--port", str(http), "--workers", "1"],
        cwd=side.root,
        env={**os.environ, **KEYS, "SHARDLB_REDIS_URL": found[0].rstrip(".,")},
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            request("GET", side.base + "/readyz")
            break
        except Exception:
            if time.monotonic() > deadline or side.router.poll() is not None:
                raise RuntimeError(f"{side.name}: the router did not become ready") from None
            time.sleep(0.2)
    drawn = points(players)
    began = time.monotonic()
    for board, shards in BOARDS.items():
        request("PUT", f"{side.base}/v1/boards/{board}", {"sharding": {"strategy": "hash", "shards": shards}})
        for i in range(0, players, 1000):
            scores = [
                {"player_id": f"p{j}", "points": drawn[j], "match_id": f"m{j}"}
                for j in range(i, min(players, i + 1000))
            ]
            request("POST", f"{side.base}/v1/boards/{board}/scores", {"scores": scores}, key="versus-write")
    took = time.monotonic() - began
    log(f"{side.name}: {len(BOARDS)} boards of {players:,} players posted in {took:.1f} s")


def stop(side: Side) -> None:
    if side.router is not None and side.router.poll() is None:
        os.killpg(side.router.pid, signal.SIGTERM)
        side.router.wait(30)
    side.shardlb("cluster", "down", "--dir", side.cluster_dir)


def measure(side: Side, path: str, script: Path, players: int, seconds: float) -> dict[str, Any]:
    assert side.router is not None
    script.write_text(WRK_SCRIPT.format(path=path, players=players, seed=7))
    cpu0, began = cpu_seconds(side.router.pid) or 0.0, time.monotonic()
    got = run_wrk(side.base, script, seconds, CONNECTIONS)
    wall = time.monotonic() - began
    used = (cpu_seconds(side.router.pid) or 0.0) - cpu0
    got["router_us"] = round(used / (got["rps"] * wall) * 1e6, 1) if got["rps"] else None
    return got


def table(results: dict[str, dict[str, list[dict[str, Any]]]], names: tuple[str, str]) -> list[str]:
    """Markdown: per target, each side's median requests/s (p99 ms) and router µs per request."""
    a, b = names
    lines = [
        f"| target | {a} requests/s (p99 ms) | {b} requests/s (p99 ms) | {b} / {a} "
        f"| router µs per request, {a} / {b} |",
        "|---|---:|---:|---:|---:|",
    ]
    for target, sides in results.items():
        med = {n: statistics.median(r["rps"] for r in runs) for n, runs in sides.items()}
        p99 = {n: statistics.median(r.get("p99_ms", 0.0) for r in runs) for n, runs in sides.items()}
        cpu = {n: statistics.median(r["router_us"] or 0.0 for r in runs) for n, runs in sides.items()}
        lines.append(
            f"| {target} | {med[a]:,.0f} ({p99[a]:g}) | {med[b]:,.0f} ({p99[b]:g}) "
            f"| {med[b] / med[a]:.2f} | {cpu[a]:.0f} / {cpu[b]:.0f} |"
        )
    return lines


def main() -> int:
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / ".venv" / "bin" / "python").exists():
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        print("the other checkout needs its .venv: run `make install` there", file=sys.stderr)
        return 2
    players = env_int("SHARDLB_VERSUS_PLAYERS", 200_000)
    seconds = float(env_int("SHARDLB_VERSUS_SECONDS", 8))
    rounds = env_int("SHARDLB_VERSUS_ROUNDS", 3)
    other = Path(sys.argv[1]).resolve()
    sides = (Side(f"other ({other.name})", other), Side("this checkout", ROOT))
    out = ROOT / "bench" / "results" / time.strftime("versus-%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {t: {s.name: [] for s in sides} for t, _ in TARGETS}
    try:
        port = 17000  # cluster bus ports at +10000 stay below the ephemeral range
        for side in sides:
            port = free_block(port)
            start(side, port, players)
            port += NODES
        for n in range(rounds):
            for i, (target, path) in enumerate(TARGETS):
                for side in sides if n % 2 == 0 else sides[::-1]:
                    got = measure(side, path, out / f"target-{i}.lua", players, seconds)
                    results[target][side.name].append(got)
                    log(f"round {n + 1}: {target}, {side.name}: {got['rps']:,.0f}/s, {got['router_us']} µs")
    finally:
        for side in sides:
            stop(side)
    (out / "versus.json").write_text(json.dumps({"players": players, "seconds": seconds, "results": results}))
    print("\n".join(table(results, (sides[0].name, sides[1].name))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
