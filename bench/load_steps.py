"""`make bench-load-steps`: a router's CPU per score at paced loads and at its maximum, beside the
library's, on boards of several shard counts, every step posting matches of its own.

    python -m bench.load_steps          # ~5 min with the defaults

One local cluster (3 masters x 1 replica). For each shard count in SHARDLB_STEPS_SHARDS (3,16), a
fresh board of SHARDLB_STEPS_PLAYERS (200000) players, then these steps on it, each through a fresh
router of one process (as `make bench` writes):

- paced: for each rate in SHARDLB_STEPS_RATES (5000,15000 scores/s), bench.pacer's users posting one
  match (10 scores) a request at 5 requests a second each: rate / 50 users, spread evenly;
- back to back: SHARDLB_STEPS_CONNECTIONS (64; 0 leaves it out) users each posting again as soon as
  it is answered;
- the library (SHARDLB_STEPS_LIBRARY=0 leaves it out): bench.drivers' raw writes (batches of 1,
  then of 100 matches, 4 callers in each of 2 processes) straight at the board, no HTTP, for
  SHARDLB_STEPS_SECONDS - SHARDLB_STEPS_SETTLE s each; from the two, a write script call's fixed
  part and a score's part of the masters' and the replicas' CPU (``call_costs``, which `shardlb
  plan` takes).

The router's, the masters' and the replicas' CPU is read from /proc over each step's held part
(after SHARDLB_STEPS_SETTLE s of the SHARDLB_STEPS_SECONDS each runs) and divided by the scores
written in it; the nodes' INFO commandstats give the script calls, so the scores a call too.
Every step posts new matches: bench.pacer draws its own seed each run and the
library's seed is drawn here, so no step's writes repeat an earlier step's (a repeated match is a
duplicate, a check for the store instead of a write: docs/design-notes.md, "The pacer's runs
replayed each other's matches"). Every other SHARDLB_* variable reaches the routers, so a setting
can be compared by running it again: ``SHARDLB_COALESCE_DELAY_MS=5 python -m bench.load_steps``.

Writes bench/results/load-steps-<timestamp>/load-steps.json and load-steps.md (the table), copies
both to bench/results/latest/, and prints the table.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import population
from bench.commandstats import CommandMeter
from bench.drivers import Job
from bench.harness import env_int, env_ints, log, publish, run_dir
from bench.procs import CpuMeter
from bench.run import ADMIN_KEY, WRITE_KEY, driver_phase
from bench.services import ROOT, Router, free_port
from bench.testbed import create_board, machine, node_pids, start_cluster
from bench.workload import Workload

USER_RPS = 5  # requests a second of each paced user
LIBRARY_BATCHES = (1, 100)  # matches a batch of the library's two steps: small calls, then large
BACK_TO_BACK_RPS = 1000.0  # bench.pacer's pace for a user that posts again as soon as it is answered
STORE = ("redis masters", "redis replicas")


def paced_users(rate: int, players_per_match: int, rps: float = USER_RPS, fresh_share: float = 1.0) -> int:
    """Users at ``rps`` one-match requests a second each that offer ``rate`` fresh scores a second,
    when ``fresh_share`` of the posts are new results (the rest replay one: Workload.fresh_share)."""
    return max(1, round(rate / (rps * players_per_match * fresh_share)))


def plan(
    rates: list[int], connections: int, players_per_match: int, fresh_share: float = 1.0
) -> list[tuple[str, int, float]]:
    """The router's steps as (name, users, requests a second per user): the paced rates, then
    ``connections`` users back to back (none when 0)."""
    steps = [
        (f"{rate:,} scores/s paced", paced_users(rate, players_per_match, fresh_share=fresh_share), USER_RPS)
        for rate in rates
    ]
    if connections:
        steps.append((f"{connections} connections back to back", connections, BACK_TO_BACK_RPS))
    return steps


def count(name: str, default: int) -> int:
    """A count from the environment that may be 0 (a step left out)."""
    raw = os.environ.get(name, "") or str(default)
    if not raw.isdigit():
        raise SystemExit(f"{name}: expected a whole number, 0 or more, got {raw!r}")
    return int(raw)


def per_score(cpu_s: dict[str, float], scores: float) -> dict[str, float | None]:
    """µs of CPU per score of the router and of the store (masters and replicas) over ``scores``."""

    def us(seconds: float) -> float | None:
        return round(seconds / scores * 1e6, 1) if scores else None

    return {"router_us": us(cpu_s.get("router", 0.0)), "store_us": us(sum(cpu_s.get(g, 0.0) for g in STORE))}


def table(rows: list[dict[str, Any]]) -> str:
    """The steps as a markdown table: one line per board and step. The library's line has its own CPU
    per score (its callers' processes) where the others have the router's; the store is the masters
    and their replicas. The failures are the pacer's failed requests, or the library's failed
    batches."""
    lines = [
        "| shards | step | scores/s | scores a call | router (library) µs per score | store µs per score "
        "| p99 ms | failures |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['shards']} | {row['step']} | skipped: {row['skipped']} | | | | | |")
            continue
        # The scores/s are those of the requests (or library batches) that succeeded.
        failures = row.get("failures", row.get("errors"))
        p99 = "-" if row.get("p99_ms") is None else f"{row['p99_ms']:.1f}"
        if row.get("router_us") is not None:
            router = f"{row['router_us']:.1f}"
        elif row.get("driver_us") is not None:  # the library's own CPU, in its callers' processes
            router = f"({row['driver_us']:.1f})"
        else:
            router = "-"
        per_call = "-" if row.get("scores_per_call") is None else f"{row['scores_per_call']:.1f}"
        lines.append(
            f"| {row['shards']} | {row['step']} | {row['scores_per_s']:,.0f} | {per_call} | {router} | "
            f"{row['store_us']:.1f} | {p99} | {'-' if failures is None else failures} |"
        )
    return "\n".join(lines) + "\n"


def call_lines(costs: dict[str, dict[str, float]]) -> str:
    """The call costs of each board (``call_costs``), as lines under the table."""
    lines = [
        f"- {shards} shards, a write script call: masters {c['redis_master_us_per_call']:.1f} µs a call "
        f"+ {c['redis_master_us_per_score_in_call']:.2f} µs a score, replicas "
        f"{c['redis_replica_us_per_call']:.1f} + {c['redis_replica_us_per_score_in_call']:.2f} "
        "(from the library's batches of "
        f"{' and '.join(str(m) for m in LIBRARY_BATCHES)} matches)"
        for shards, c in costs.items()
    ]
    return "\n".join(lines) + "\n" if lines else ""


def pacer_step(
    url: str,
    workload: Workload,
    groups: dict[str, list[int]],
    users: int,
    rps: float,
    seconds: float,
    settle: float,
    log_to: Path,
) -> dict[str, Any]:
    """bench.pacer's ``users`` at ``rps`` one-match requests a second each (1000: back to back)
    through a fresh router of one process; scores/s, latency and CPU per score over the held part."""
    env = {"SHARDLB_ADMIN_KEYS": ADMIN_KEY, "SHARDLB_WRITE_KEYS": WRITE_KEY, "SHARDLB_LOG_LEVEL": "warning"}
    with Router(url, free_port(22400), 1, log_to, env) as router:
        assert router.proc is not None
        command = [
            *(sys.executable, "-m", "bench.pacer", "--url", router.url, "--users", str(users)),
            *("--rps", str(rps), "--seconds", str(seconds), "--settle", str(settle), "--key", WRITE_KEY),
        ]
        pacer_env = {**os.environ, "SHARDLB_BOARD": workload.board, "SHARDLB_PLAYERS": str(workload.players)}
        proc = subprocess.Popen(
            command, env=pacer_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )
        time.sleep(settle)
        commands = CommandMeter(url).start()
        meter = CpuMeter({**groups, "router": [router.proc.pid]}).start()
        time.sleep(max(1.0, seconds - settle - 0.5))
        cpu = meter.stop()
        cpu["commands"] = commands.stop()
        stdout, stderr = proc.communicate(timeout=seconds + 60)
    if proc.returncode != 0 or not stdout.strip():
        return {"skipped": f"bench.pacer exited {proc.returncode}: {stderr.strip()[-300:]}"}
    got = json.loads(stdout.strip().splitlines()[-1])
    scores_per_s = got["scores"] / (seconds - settle)  # the pacer counts requests started after settle
    # Exact retries write nothing new but ride the script calls too: a call's size counts them.
    sent_per_s = scores_per_s + got.get("replayed_scores", 0) / (seconds - settle)
    calls = cpu["commands"].get("evalsha", {}).get("calls", 0)
    return {
        "users": users,
        "scores_per_s": round(scores_per_s),
        "script_calls": calls,
        # the scores in the metered window over the write script calls the nodes counted in it
        "scores_per_call": round(sent_per_s * cpu["wall_s"] / calls, 2) if calls else None,
        "p99_ms": got.get("p99_ms"),
        "failures": got.get("failures"),
        **per_score(cpu["cpu_s"], scores_per_s * cpu["wall_s"]),
        "cpu": cpu,
    }


def library_step(
    url: str, workload: Workload, groups: dict[str, list[int]], seconds: float, batch_matches: int
) -> dict[str, Any]:
    """bench.drivers' raw writes at the board in batches of ``batch_matches`` matches, with a seed of
    their own (new matches); the script calls they made, from the nodes' command counts. Its rate
    and CPU are per score written, as the router's steps' are; ``scores`` are all those the calls
    carried, the exact retries' too (the size of a call, for ``call_costs``)."""
    job = Job("raw writes", url, workload, seconds, 4, batch_matches, seed=random.randrange(1, 2**31))
    phase = driver_phase(job, 2, groups)
    # All of them inside the metered window, which also holds the start-up.
    written = phase["items"]
    scores = written + phase.get("replayed_items", 0)
    calls = phase["cpu"].get("commands", {}).get("evalsha", {}).get("calls", 0)
    return {
        "scores_per_s": round(phase["items_per_s"]),
        "p99_ms": None,
        "router_us": None,
        "store_us": per_score(phase["cpu"]["cpu_s"], written)["store_us"],
        "driver_us": round(phase["driver_cpu_seconds"] / written * 1e6, 1) if written else None,
        "written": written,
        "errors": phase["errors"],
        "scores": scores,
        "script_calls": calls,
        "scores_per_call": round(scores / calls, 2) if calls else None,
        "cpu": phase["cpu"],
    }


def call_costs(small: dict[str, Any], large: dict[str, Any]) -> dict[str, float]:
    """A script call's fixed part and each of its scores' part of the masters' (and the replicas')
    CPU, from two library steps of different batch sizes: CPU = calls x per call + scores x per
    score, two equations in two unknowns (none when the batches were the same size)."""
    k1, n1, k2, n2 = small["script_calls"], small["scores"], large["script_calls"], large["scores"]
    det = k1 * n2 - k2 * n1
    if not (k1 and k2 and n1 and n2) or abs(det) < 1e-9 * k1 * n2:
        return {}
    out = {}
    for node, group in (("master", "redis masters"), ("replica", "redis replicas")):
        c1, c2 = small["cpu"]["cpu_s"].get(group, 0.0), large["cpu"]["cpu_s"].get(group, 0.0)
        per_call = (c1 * n2 - c2 * n1) / det
        per_score = (k1 * c2 - k2 * c1) / det
        out[f"redis_{node}_us_per_call"] = round(max(0.0, per_call) * 1e6, 1)
        out[f"redis_{node}_us_per_score_in_call"] = round(max(0.0, per_score) * 1e6, 2)
    return out


def main() -> int:
    shard_counts = env_ints("SHARDLB_STEPS_SHARDS", "3,16")
    rates = env_ints("SHARDLB_STEPS_RATES", "5000,15000")
    connections = count("SHARDLB_STEPS_CONNECTIONS", 64)
    library = count("SHARDLB_STEPS_LIBRARY", 1)
    players = env_int("SHARDLB_STEPS_PLAYERS", 200_000)
    seconds = float(env_int("SHARDLB_STEPS_SECONDS", 20))
    settle = float(env_int("SHARDLB_STEPS_SETTLE", 6))
    if settle >= seconds:
        raise SystemExit("SHARDLB_STEPS_SETTLE must be below SHARDLB_STEPS_SECONDS")
    name = time.strftime("load-steps-%Y%m%d-%H%M%S")
    out = run_dir(name)
    settings = {k: v for k, v in os.environ.items() if k.startswith("SHARDLB_") and "KEY" not in k}
    result: dict[str, Any] = {"name": name, "machine": machine(), "settings": settings, "rows": []}
    cluster = start_cluster(3, 1, out / "cluster", start=22100)
    try:
        masters, replicas = node_pids(cluster)
        groups = {"redis masters": masters, "redis replicas": replicas}
        for shards in shard_counts:
            workload = replace(Workload.from_env(), board=f"steps-{shards}", players=players)
            asyncio.run(create_board(cluster.url, workload, shards))
            population.load_parallel(cluster.url, workload, 0, players, 2)
            steps = plan(rates, connections, workload.players_per_match, workload.fresh_share)
            for step, users, rps in steps:
                log(f"{shards} shards, {step}: {users} users")
                row = pacer_step(
                    cluster.url, workload, groups, users, rps, seconds, settle, out / "router.log"
                )
                result["rows"].append({"shards": shards, "step": step, **row})
            if library:
                steps = {}
                for matches in LIBRARY_BATCHES:
                    log(f"{shards} shards, the library, {matches} match(es) a batch")
                    steps[matches] = library_step(cluster.url, workload, groups, seconds - settle, matches)
                    name = f"the library, batches of {matches} match{'es' if matches > 1 else ''}"
                    result["rows"].append({"shards": shards, "step": name, **steps[matches]})
                costs = call_costs(*(steps[m] for m in LIBRARY_BATCHES))
                if costs:
                    result.setdefault("call_costs", {})[str(shards)] = costs
                    log(f"{shards} shards: {costs}")
    finally:
        cluster.down()
    (out / "load-steps.json").write_text(json.dumps(result, indent=2) + "\n")
    text = table(result["rows"]) + "\n" + call_lines(result.get("call_costs", {}))
    (out / "load-steps.md").write_text(text)
    publish(out, ["load-steps.json", "load-steps.md"])
    print(text)
    log(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
