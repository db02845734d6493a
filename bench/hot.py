"""`make bench`'s hot reads: what one router process answers of its two hottest reads, beside the
textbook service on the same cluster and players (issue 13's read goals).

    python -m bench.hot            # alone: its own cluster and population (SHARDLB_BENCH_* settings)

One router process (``python -m router.server --workers 1``) and one textbook service process
(bench/textbook_service.py: Starlette over ONE sorted set on a plain connection to its master) are
each driven by wrk (one thread, SHARDLB_BENCH_HOT_CONNECTIONS connections, keep-alive) for
SHARDLB_BENCH_HOT_SECONDS per target, one target at a time. The servers run side by side and the
targets take turns, in SHARDLB_BENCH_HOT_ROUNDS rounds of an equal share of those seconds each, so
that a drift of the machine's speed during the phase (these VMs drift by a third within minutes)
weighs on the router's targets and the textbook's alike:

- ``/healthz`` of each: the trivial endpoint, the server's own ceiling on this machine;
- the cached top-100 of each (the router's from its top cache, the textbook's one ZREVRANGE);
- "my rank" of random players: on the router, on a board with one shard per master (the layout
  ``shardlb plan`` recommends: bench/plan.py) and on the bench's board (SHARDLB_BENCH_SHARDS, 16),
  and once more on the first through a router reading from replicas (SHARDLB_READ_FROM=replicas);
  on a band board, exact and with ``max_age_ms`` (the other bands' sizes up to 1 s old, so a read
  touches the player's home shard and band only);
  on the textbook service, ZSCORE + ZREVRANK + ZCARD in one pipeline.

The CPU of the server process and of the Redis masters and replicas is metered per target, so
each row gives CPU µs per request on both sides: requests and CPU summed over the rounds, the
latency percentiles the median of the rounds'. wrk comes from Debian's package
(scripts/ensure-wrk.sh); without it the phase is skipped and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import peers, population
from bench.harness import env_int, log
from bench.procs import CpuMeter
from bench.read_goals import BAND_RANK, KEPT_AGE_MS, KEPT_RANK
from bench.services import ROOT, Router, free_port, stop_group
from bench.testbed import create_board, masters_memory
from bench.workload import Workload

READ_ENV = {
    "SHARDLB_ADMIN_KEYS": "bench-admin",
    "SHARDLB_WRITE_KEYS": "bench-write",
    "SHARDLB_READ_RATE": "0",
}
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}

# One wrk script for every target: a fixed path, or the path with a random player of the population.
WRK_SCRIPT = """
local path, players = "{path}", {players}
local id = 0
function init(args)
  math.randomseed({seed})
end
request = function()
  if string.find(path, "{{player}}", 1, true) then
    id = math.random(0, players - 1)
    return wrk.format("GET", (string.gsub(path, "{{player}}", "p" .. id)))
  end
  return wrk.format("GET", path)
end
"""


@dataclass(frozen=True)
class Target:
    name: str
    server: str  # "router", "router-replicas" or "textbook"
    path: str  # "{player}" is replaced by a random player per request


def targets(board: str, hot_board: str, key: str, band_board: str | None = None) -> list[Target]:
    """What is measured, in order (``key``: the textbook service's sorted set, for the label)."""
    banded = (
        []
        if band_board is None
        else [
            Target(f"{BAND_RANK}{band_board}", "router", f"/v1/boards/{band_board}/players/{{player}}"),
            Target(
                f"{KEPT_RANK}{band_board}",
                "router",
                f"/v1/boards/{band_board}/players/{{player}}?max_age_ms={KEPT_AGE_MS}",
            ),
        ]
    )
    return [
        Target("router /healthz", "router", "/healthz"),
        Target("router top-100 (cached)", "router", f"/v1/boards/{board}/top"),
        Target(f"router my rank, {hot_board}", "router", f"/v1/boards/{hot_board}/players/{{player}}"),
        *banded,
        Target(f"router my rank, {board}", "router", f"/v1/boards/{board}/players/{{player}}"),
        Target(
            f"router my rank, {hot_board}, reads from replicas",
            "router-replicas",
            f"/v1/boards/{hot_board}/players/{{player}}",
        ),
        Target("textbook /healthz", "textbook", "/healthz"),
        Target(f"textbook top-100 ({key})", "textbook", "/top"),
        Target(f"textbook my rank ({key})", "textbook", "/players/{player}"),
    ]


def wrk_available() -> str | None:
    """None when wrk is on PATH, else why the phase is skipped."""
    if shutil.which("wrk") is None:
        return "wrk not found: `bash scripts/ensure-wrk.sh` installs Debian's wrk (as root)"
    return None


def parse_wrk(text: str) -> dict[str, Any]:
    """Requests, requests/s, latency percentiles (ms) and non-2xx answers of ``wrk --latency``."""
    out: dict[str, Any] = {"requests": 0, "rps": 0.0, "non_2xx": 0, "socket_errors": 0}
    for line in text.splitlines():
        line = line.strip()
        if m := re.fullmatch(r"(\d+) requests in ([\d.]+)(\w+),.*", line):
            out["requests"] = int(m[1])
        elif m := re.fullmatch(r"Requests/sec:\s+([\d.]+)", line):
            out["rps"] = float(m[1])
        elif m := re.fullmatch(r"(50|75|90|99)%\s+([\d.]+)(us|ms|s)", line):
            out[f"p{m[1]}_ms"] = round(float(m[2]) * _UNITS[m[3]], 3)
        elif m := re.fullmatch(r"Non-2xx or 3xx responses: (\d+)", line):
            out["non_2xx"] = int(m[1])
        elif line.startswith("Socket errors:"):
            out["socket_errors"] = sum(int(n) for n in re.findall(r"\d+", line))
    return out


def run_wrk(url: str, script: Path, seconds: float, connections: int) -> dict[str, Any]:
    done = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds:.0f}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        check=False,
    )
    return {**parse_wrk(done.stdout), "returncode": done.returncode}


class TextbookService:
    """bench/textbook_service.py in its own process group."""

    def __init__(self, redis_url: str, key: str, port: int, log_path: Path) -> None:
        self.redis_url, self.key, self.port, self.log = redis_url, key, port, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> TextbookService:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "bench.textbook_service", "--port", str(self.port)),
                    *("--redis-url", self.redis_url, "--key", self.key),
                ],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"textbook service exited; see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=2):
                    return self
            except (OSError, urllib.error.URLError):
                time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"textbook service not up within 30 s; see {self.log}")

    def __exit__(self, *_: object) -> None:
        stop_group(self.proc)


def measure(
    target: Target,
    url: str,
    pid: int,
    redis: dict[str, list[int]],
    out: Path,
    players: int,
    seconds: float,
    connections: int,
    profiled: bool = True,
) -> dict[str, Any]:
    """One target under wrk, with the server's and the cluster's CPU per request (and, for the
    router targets of PROFILED when ``profiled``, a py-spy profile under the same load)."""
    script = out / f"hot-{re.sub(r'[^a-z0-9]+', '-', target.name.lower()).strip('-')}.lua"
    script.write_text(WRK_SCRIPT.format(path=target.path, players=players, seed=len(target.name)))
    meter = CpuMeter({**redis, "server": [pid]}).start()
    try:
        got = run_wrk(url, script, seconds, connections)
    finally:
        cpu = meter.stop()
    requests = got["requests"] or 1
    used = cpu["cpu_s"]
    got.update(
        name=target.name,
        server=target.server,
        server_us=round(used.get("server", 0.0) / requests * 1e6, 1),
        masters_us=round(used.get("redis masters", 0.0) / requests * 1e6, 1),
        replicas_us=round(used.get("redis replicas", 0.0) / requests * 1e6, 1),
        other_cpu_s=cpu.get("other_cpu_s"),
        steal_cpu_s=cpu.get("steal_cpu_s"),
    )
    log(
        f"hot: {target.name}: {got['rps']:.0f}/s, p99 {got.get('p99_ms')} ms, server {got['server_us']} µs, "
        f"masters {got['masters_us']} µs, replicas {got['replicas_us']} µs per request"
    )
    if profiled and target.server == "router" and target.name.startswith(PROFILED):
        got["profile"] = profile(pid, url, script, min(seconds, 5.0), connections, out)
    return got


def combined(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One target's rounds as one row: requests, answers and CPU summed (CPU per request weighted
    by each round's requests), the rate over the rounds' time, latency the median of the rounds'.
    wrk's Requests/sec counts every answer, a quick 503 too: ``rps`` is the 2xx answers' rate
    (since 2026-12-05), ``answers_per_s`` wrk's."""
    out = dict(parts[-1])
    requests = sum(p["requests"] for p in parts)
    seconds = sum(p["requests"] / p["rps"] for p in parts if p["rps"])
    for name in ("non_2xx", "socket_errors"):
        out[name] = sum(p.get(name, 0) for p in parts)
    out["requests"] = requests
    out["answers_per_s"] = requests / seconds if seconds else 0.0
    out["rps"] = (requests - out["non_2xx"]) / seconds if seconds else 0.0
    for name in ("server_us", "masters_us", "replicas_us"):
        out[name] = round(sum(p[name] * p["requests"] for p in parts) / requests, 1) if requests else 0.0
    for name in [k for k in parts[-1] if k.endswith("_ms")]:
        values = sorted(p[name] for p in parts if p.get(name) is not None)
        out[name] = values[len(values) // 2] if values else None
    out["rounds"] = len(parts)
    return out


PROFILED = ("router top-100", "router my rank")  # the router targets of issue 13's read goals
PROFILE_ROWS = 12


def py_spy() -> str | None:
    """The py-spy next to this interpreter (the bench extra), or on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def fold(raw: str, rows: int = PROFILE_ROWS) -> dict[str, Any]:
    """py-spy's raw output (``frame;frame;... count`` lines) as the functions that took the most
    samples: by their own time, and with their callees for the project's own functions. Only the
    main thread's samples count: a router serves from its event loop there, and its other
    threads only wait (uvicorn's worker answers its supervisor's pings from one, blocked in a
    pipe read that py-spy does not see as idle)."""
    total, own, within = 0, Counter[str](), Counter[str]()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit() or stack.startswith(_THREAD):
            continue
        n = int(count)
        total += n
        frames = [_frame(f) for f in stack.split(";")]
        own[frames[-1]] += n
        for frame in dict.fromkeys(f for f in frames if f.endswith(_OURS)):
            within[frame] += n
    share = lambda c: [(name, round(100 * n / total, 1)) for name, n in c.most_common(rows)]  # noqa: E731
    return {"samples": total, "self": share(own), "inclusive": share(within)} if total else {}


_THREAD = "Thread._bootstrap ("  # the first frame of every thread started by `threading`

# The project's modules on a read's or a write's path: "with callees" lists only their functions.
_OURS = tuple(
    f"({package}/{module}.py)"
    for package, modules in (
        (
            "router",
            "app routes media scores middleware cache service auth limiter history params gate hot "
            "coalescer moderation boards metrics",
        ),
        ("shardlb", "board reads fanout connection merge periods times codec loops"),
    )
    for module in modules.split()
)


def _frame(text: str) -> str:
    """``function (dir/file.py)`` of py-spy's ``function (/some/path/dir/file.py:line)``."""
    name, _, where = text.partition(" (")
    path = where.rsplit(":", 1)[0]
    return f"{name} ({'/'.join(path.split('/')[-2:])})"


def profile(pid: int, url: str, script: Path, seconds: float, connections: int, out: Path) -> dict[str, Any]:
    """The server process under the same load, sampled by py-spy (100 Hz) while wrk runs again."""
    load = subprocess.Popen(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds + 2:.0f}s", "-s", str(script), url],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(1)
        return sample(pid, seconds, out / f"{script.stem}.spy")
    finally:
        load.wait(timeout=seconds + 30)


def sample(pid: int, seconds: float, raw: Path) -> dict[str, Any]:
    """Process ``pid`` sampled by py-spy at 100 Hz for ``seconds``, folded (``fold``); the raw
    samples go to ``raw``."""
    spy = py_spy()
    if spy is None:
        return {"skipped": "py-spy not installed (pip install py-spy)"}
    done = subprocess.run(
        [spy, "record", "-p", str(pid), "-d", f"{seconds:.0f}", "-r", "100", "-f", "raw", "-o", str(raw)],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        check=False,
    )
    if done.returncode != 0 or not raw.exists():
        return {"skipped": f"py-spy failed: {(done.stderr or done.stdout).strip()[-200:]}"}
    return fold(raw.read_text())


def hot_board_workload(workload: Workload, masters: int) -> Workload:
    return replace(workload, board=f"{workload.board}-s{masters}")


def band_board_workload(workload: Workload, masters: int) -> Workload:
    return replace(workload, board=f"{workload.board}-b{masters}")


def band_starts(workload: Workload, bands: int) -> list[int]:
    """Band starts at the quantiles of the population's points, so the bands hold about as many
    players each (what ``shardlb bands`` proposes for a live board from its own rows)."""
    starts = [0, *(workload.points.at(k / bands) for k in range(1, bands))]
    return sorted(set(starts))


def band_sharding(workload: Workload, masters: int) -> dict[str, Any]:
    """The band layout the bench reads: one home shard and one band per master."""
    return {"strategy": "band", "shards": masters, "bands": band_starts(workload, masters)}


def prepare(url: str, workload: Workload, masters: int, processes: int) -> Workload:
    """The board with one shard per master, holding the same players as the bench's board."""
    hot = hot_board_workload(workload, masters)
    asyncio.run(create_board(url, hot, masters))
    population.load_parallel(url, hot, 0, hot.players, processes)
    return hot


def prepare_band(url: str, workload: Workload, masters: int, processes: int) -> tuple[Workload, float]:
    """The band board (``band_sharding``), holding the same players as the bench's board; and its
    bytes per player on the masters (home rows, band rows and both version hashes)."""
    banded = band_board_workload(workload, masters)
    asyncio.run(create_board(url, banded, masters, sharding=band_sharding(workload, masters)))
    before = asyncio.run(masters_memory(url))
    population.load_parallel(url, banded, 0, banded.players, processes)
    after = asyncio.run(masters_memory(url))
    return banded, round((after - before) / banded.players, 1)


def run(
    url: str,
    workload: Workload,
    masters: int,
    redis: dict[str, list[int]],
    out: Path,
    processes: int = 2,
) -> dict[str, Any]:
    """The whole hot phase on a cluster already holding the bench's board and textbook set."""
    missing = wrk_available()
    if missing:
        log(f"hot reads skipped: {missing}")
        return {"skipped": missing}
    seconds = float(env_int("SHARDLB_BENCH_HOT_SECONDS", 9))
    connections = env_int("SHARDLB_BENCH_HOT_CONNECTIONS", 32)
    rounds = max(1, env_int("SHARDLB_BENCH_HOT_ROUNDS", 3))
    log(f"hot reads: board of {masters} shards with the same {workload.players:,} players")
    t0 = time.monotonic()
    hot = prepare(url, workload, masters, processes)
    load_s = round(time.monotonic() - t0, 1)
    t0 = time.monotonic()
    banded, band_bytes = prepare_band(url, workload, masters, processes)
    band_load_s = round(time.monotonic() - t0, 1)
    key = peers.textbook_key(workload.board)
    rows: list[dict[str, Any]] = []
    plan = targets(workload.board, hot.board, key, banded.board)
    servers = {
        "router": lambda: Router(url, free_port(22400), 1, out / "hot-router.log", READ_ENV),
        "router-replicas": lambda: Router(
            url,
            free_port(22400),
            1,
            out / "hot-router-replicas.log",
            {**READ_ENV, "SHARDLB_READ_FROM": "replicas"},
        ),
        "textbook": lambda: TextbookService(url, key, free_port(22450), out / "hot-textbook.log"),
    }
    with contextlib.ExitStack() as stack:
        running = {name: stack.enter_context(start()) for name, start in servers.items()}
        parts: dict[str, list[dict[str, Any]]] = {t.name: [] for t in plan}
        for _ in range(rounds):
            for target in plan:
                server = running[target.server]
                pid = server.proc.pid if server.proc else 0
                parts[target.name].append(
                    measure(
                        target,
                        server.url,
                        pid,
                        redis,
                        out,
                        workload.players,
                        seconds / rounds,
                        connections,
                        profiled=False,
                    )
                )
        for target in plan:
            row = combined(parts[target.name])
            server = running[target.server]
            if target.server == "router" and target.name.startswith(PROFILED) and server.proc:
                script = out / f"hot-{re.sub(r'[^a-z0-9]+', '-', target.name.lower()).strip('-')}.lua"
                row["profile"] = profile(
                    server.proc.pid, server.url, script, min(seconds, 5.0), connections, out
                )
            rows.append(row)
    return {
        "seconds_per_target": seconds,
        "rounds": rounds,
        "connections": connections,
        "hot_board": hot.board,
        "hot_board_shards": masters,
        "hot_board_load_s": load_s,
        "band_board": banded.board,
        "band_sharding": band_sharding(workload, masters),
        "band_board_load_s": band_load_s,
        "band_bytes_per_player": band_bytes,
        "targets": rows,
    }


def main() -> int:
    """Alone: a cluster of its own, the population loaded, then the phase; prints the table."""
    from bench import read_goals
    from bench.harness import run_dir
    from bench.run import Settings
    from bench.testbed import node_pids, preload, start_cluster

    s = Settings.from_env()
    workload = replace(Workload.from_env(), players=s.players)
    out = run_dir("hot-" + time.strftime("%Y%m%d-%H%M%S"))
    cluster = start_cluster(s.masters, s.replicas, out / "cluster", start=22100)
    try:
        asyncio.run(create_board(cluster.url, workload, s.shards))
        preload(cluster.url, workload, s.driver_processes)
        masters, replicas = node_pids(cluster)
        result = run(
            cluster.url, workload, s.masters, {"redis masters": masters, "redis replicas": replicas}, out
        )
    finally:
        cluster.down()
    print("\n".join(read_goals.hot_table({"hot": result})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
