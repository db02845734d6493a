"""Turning a run's measurements into summary.json numbers, summary.md text and the derived costs
that ``bench.plan`` sizes a deployment from."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench import durability_report, locust_csv, read_goals
from bench.shapes import Stage

SPAWN_SETTLE_S = 2.0  # the first seconds of a ramp step still spawn users; leave them out
LOCUST_BOUND_SHARE = 0.9  # Locust's own warning threshold (90% of a core)
OTHER_LOAD = 0.2  # cores used by processes outside the bench, above which a phase's figure is suspect
STOLEN = 0.1  # cores the hypervisor gave other guests, above which a phase's figure is suspect
# Failed requests (or driver calls) above this share of a phase's: its rate counts only what
# succeeded, but the service refused part of the load offered, so no goal is met on it.
FAILED_SHARE = 0.01
POST_NAME = "/v1/boards/[board]/scores"  # the locustfile's name for every score post


def _endpoints(run_stats: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for e in locust_csv.read_stats(run_stats):
        out[e.key or "Aggregated"] = {
            "requests": e.requests,
            "failures": e.failures,
            "rps": round(e.rps, 1),
            "p50": e.p50,
            "p95": e.p95,
            "p99": e.p99,
            "max": round(e.max, 1),
        }
    return out


def _history_start(history: Path) -> float:
    samples = locust_csv.read_history(history, "", "Aggregated")
    return samples[0].t if samples else 0.0


def _locust(run: Any) -> dict[str, Any]:
    share = run.cpu["busiest_process_share"].get("locust", 0.0)
    return {
        "returncode": run.returncode,
        "cpu": run.cpu,
        "locust_cpu_bound": bool(run.warnings) or share >= LOCUST_BOUND_SHARE,
        "locust_warnings": run.warnings,
    }


def http_writes(run: Any, stages: list[Stage]) -> dict[str, Any]:
    """The write ramp: sustained writes/s (best 10 s window), each step's offered vs achieved."""
    endpoints = _endpoints(run.stats)
    history = locust_csv.read_history(run.history, locust_csv.SCORES_TYPE, locust_csv.SCORES_NAME)
    posts = locust_csv.read_history(run.history, "POST", POST_NAME)
    t0 = _history_start(run.history)
    steps = []
    begin = 0.0
    for stage in stages:
        achieved = locust_csv.rate_between(history, t0 + begin + SPAWN_SETTLE_S, t0 + stage.until)
        at_end = [p for p in posts if p.t <= t0 + stage.until]
        steps.append(
            {
                "until_s": stage.until,
                "users": stage.users,
                "offered": round(stage.offered),
                "achieved": round(achieved),
                "p99_ms": at_end[-1].p99_recent if at_end else math.nan,
            }
        )
        begin = stage.until
    written = locust_csv.scores_written(locust_csv.read_stats(run.stats))
    return {
        "sustained_writes_per_s": round(locust_csv.best_window(history, 10.0)),
        "scores_written": written,
        "failures": sum(v["failures"] for k, v in endpoints.items() if k != "Aggregated"),
        "steps": steps,
        "endpoints": endpoints,
        **_locust(run),
    }


def http_reads(run: Any) -> dict[str, Any]:
    """A read mix: the reads that succeeded a second. Locust's Requests/s counts failed requests
    too (a quick 503 would read as throughput), so it is scaled by the share that succeeded."""
    endpoints = _endpoints(run.stats)
    total = next((e for e in locust_csv.read_stats(run.stats) if e.key in ("", "Aggregated")), None)
    done = total.requests - total.failures if total else 0
    return {
        "reads_per_s": round(total.rps * done / total.requests, 1) if total and total.requests else 0.0,
        "requests": total.requests if total else 0,
        "failures": total.failures if total else 0,
        "endpoints": endpoints,
        **_locust(run),
    }


def sweep_point(run: Any, window: float) -> dict[str, Any]:
    history = locust_csv.read_history(run.history, locust_csv.SCORES_TYPE, locust_csv.SCORES_NAME)
    post = _endpoints(run.stats).get(f"POST {POST_NAME}", {})
    return {
        "writes_per_s": round(locust_csv.best_window(history, window)),
        "scores_written": locust_csv.scores_written(locust_csv.read_stats(run.stats)),
        "p99_ms": post.get("p99"),
        "failures": post.get("failures", 0),
        **_locust(run),
    }


def latency_step(run: Any, stages: list[Stage]) -> dict[str, Any]:
    """One constant-rate write step (shape ``soak``): the writes/s achieved while its rate was held
    (from SPAWN_SETTLE_S after it began) and the POST's p50/p95/p99 over Locust's window at the end
    of it (its last RECENT_WINDOW_S seconds; the whole run's when the history has no such row)."""
    history = locust_csv.read_history(run.history, locust_csv.SCORES_TYPE, locust_csv.SCORES_NAME)
    posts = locust_csv.read_history(run.history, "POST", POST_NAME)
    t0 = _history_start(run.history)
    begin, end = stages[-2].until if len(stages) > 1 else 0.0, stages[-1].until
    post = _endpoints(run.stats).get(f"POST {POST_NAME}", {})
    at_end = [p for p in posts if p.t <= t0 + end and not math.isnan(p.p99_recent)]
    if at_end:
        last = at_end[-1]
        latency = {"p50_ms": last.p50_recent, "p95_ms": last.p95_recent, "p99_ms": last.p99_recent}
        window = min(locust_csv.RECENT_WINDOW_S, end)
    else:
        latency = {"p50_ms": post.get("p50"), "p95_ms": post.get("p95"), "p99_ms": post.get("p99")}
        window = end
    return {
        "users": stages[-1].users,
        "offered": round(stages[-1].offered),
        "achieved": round(locust_csv.rate_between(history, t0 + begin + SPAWN_SETTLE_S, t0 + end)),
        **latency,
        "latency_window_s": window,
        "requests": post.get("requests", 0),
        "failures": post.get("failures", 0),
        **_locust(run),
    }


def _http_read_count(reads: dict[str, Any]) -> int:
    """Requests of the HTTP read phase, every endpoint together."""
    count: int = reads.get("endpoints", {}).get("Aggregated", {}).get("requests", 0)
    return count


def _per(cpu_s: float | None, count: float) -> float | None:
    return round(cpu_s / count * 1e6, 1) if cpu_s is not None and count else None


def costs(summary: dict[str, Any]) -> dict[str, Any]:
    """CPU microseconds per operation and bytes per player, as measured in this run."""
    out: dict[str, Any] = {"bytes_per_player": summary.get("population", {}).get("board_bytes_per_player")}
    raw = summary.get("raw", {})
    if "writes" in raw:
        w = raw["writes"]
        out["redis_master_us_per_write"] = _per(w["cpu"]["cpu_s"].get("redis masters"), w["items"])
        out["redis_replica_us_per_write"] = _per(w["cpu"]["cpu_s"].get("redis replicas"), w["items"])
        out["library_us_per_write"] = _per(w["driver_cpu_seconds"], w["items"])
    if "reads" in raw:
        r = raw["reads"]
        out["redis_master_us_per_read"] = _per(r["cpu"]["cpu_s"].get("redis masters"), r["ops"])
        out["library_us_per_read"] = _per(r["driver_cpu_seconds"], r["ops"])
    http = summary.get("http", {})
    if "writes" in http:
        w = http["writes"]
        out["router_us_per_write"] = _per(w["cpu"]["cpu_s"].get("router"), w["scores_written"])
        out["locust_us_per_write"] = _per(w["cpu"]["cpu_s"].get("locust"), w["scores_written"])
    # The router's cost per read on the layout `shardlb plan` recommends (one shard per master), the
    # one its model sizes routers for; the bench's own board when that phase did not run.
    planned = http.get("reads_planned", {})
    r = planned if "cpu" in planned else http.get("reads", {})
    if "cpu" in r:
        out["router_us_per_read"] = _per(r["cpu"]["cpu_s"].get("router"), _http_read_count(r))
    out.update(request_costs(summary))
    out.update(durability_report.costs(summary))
    out.update(read_goals.read_costs(summary))
    out.update(band_costs(summary))
    return out


def request_costs(summary: dict[str, Any]) -> dict[str, float]:
    """What one request costs the router whatever its scores, from the light client's two maximums
    (bench/run.py ``light_client``): the router's CPU per write is a per-score part plus that over
    the scores a request carries, so at s1 and s2 scores a request it is (r1 - r2) / (1/s1 - 1/s2).
    With the scores a request of the ramp carries (router_us_per_write's), bench/plan.py sizes
    routers for other request sizes (``--scores-per-request``)."""
    light = summary.get("light_client", {})
    batched = light.get("batched", {})
    one = summary.get("workload", {}).get("players_per_match")
    if "skipped" in light or not batched or "skipped" in batched or not one:
        return {}
    r1, r2 = light.get("router_us"), batched.get("router_us")
    s1, s2 = light.get("scores_per_request", one), batched.get("scores_per_request")
    if not (r1 and r2 and s2) or s2 == s1:
        return {}
    return {
        "router_us_per_request": round(max(0.0, (r1 - r2) / (1 / s1 - 1 / s2)), 1),
        "router_scores_per_request": one,
    }


def _masters_per_write(step: dict[str, Any]) -> float | None:
    masters, n = step.get("cpu", {}).get("cpu_s", {}).get("redis masters"), step.get("scores_written")
    return masters / n * 1e6 if masters and n else None


def band_costs(summary: dict[str, Any]) -> dict[str, float]:
    """A band board's costs beside the hash board of one shard per master, as ratios of this run's
    figures (bench/plan.py ``--sharding band`` scales the hash board's costs by them): store and
    router CPU per mix read, per player-score write, and the band board's bytes per player."""
    http, out = summary.get("http", {}), {}
    band, planned = http.get("reads_band", {}), http.get("reads_planned", {})
    if "cpu" in band and "cpu" in planned:
        per: dict[str, dict[str, float | None]] = {}
        for name, r in (("band", band), ("hash", planned)):
            cpu, n = r["cpu"]["cpu_s"], _http_read_count(r)
            store = cpu.get("redis masters", 0.0) + cpu.get("redis replicas", 0.0)
            per[name] = {"store": _per(store, n), "router": _per(cpu.get("router"), n)}
        for part in ("store", "router"):
            a, b = per["band"][part], per["hash"][part]
            if a and b:
                out[f"band_{part}_read_factor"] = round(a / b, 3)
    writes = http.get("writes_band", {})
    if "band" in writes and "hash" in writes:
        for part in ("store", "router"):
            a, b = writes["band"].get(f"{part}_us_per_write"), writes["hash"].get(f"{part}_us_per_write")
            if part == "store":  # the masters' alone: it scales redis_master_us_per_write
                a, b = _masters_per_write(writes["band"]) or a, _masters_per_write(writes["hash"]) or b
            if a and b:
                out[f"band_{part}_write_factor"] = round(a / b, 3)
    band_bytes = summary.get("hot", {}).get("band_bytes_per_player")
    if band_bytes:
        out["band_bytes_per_player"] = band_bytes
    return out


def finish(summary: dict[str, Any]) -> None:
    """Add the ratios, the goal check (reported, never asserted) and the costs."""
    raw_w = summary.get("raw", {}).get("writes", {}).get("items_per_s")
    raw_r = summary.get("raw", {}).get("reads", {}).get("items_per_s")
    http = summary.get("http", {})
    http_w = http.get("writes", {}).get("sustained_writes_per_s")
    http_r = http.get("reads", {}).get("reads_per_s")
    ratios = {
        "router_over_raw_writes": round(http_w / raw_w, 2) if http_w is not None and raw_w else None,
        "router_over_raw_reads": round(http_r / raw_r, 2) if http_r is not None and raw_r else None,
    }
    summary["ratios"] = ratios
    summary["failed"] = failed = failed_shares(summary)
    goal = summary["goal"]
    goal["writes_met"] = http_w is not None and http_w >= goal["writes_per_s"] and "http writes" not in failed
    goal["ratio_met"] = (
        ratios["router_over_raw_writes"] is not None
        and ratios["router_over_raw_writes"] >= goal["router_over_raw"]
        and not {"http writes", "raw writes"} & set(failed)
    )
    summary["costs"] = costs(summary)
    summary["cpu_per_write"] = cpu_per_write(summary)
    summary["contaminated"] = contaminated(summary)
    summary["stolen"] = stolen(summary)
    durability_report.finish(summary)
    read_goals.finish(summary)


def cpu_per_write(summary: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Whole-machine CPU µs per player-score write, by process kind, for the HTTP path and the raw
    limit: on one shared machine the ratio of their rates is bounded by the ratio of these sums."""
    c = costs(summary)
    out: dict[str, dict[str, float | None]] = {}
    w = summary.get("http", {}).get("writes")
    if w:
        store = server_us(w, w["scores_written"])
        out["http"] = {"router": c["router_us_per_write"], "locust": c["locust_us_per_write"], "store": store}
    w = summary.get("raw", {}).get("writes")
    if w:
        out["raw"] = {"library": c["library_us_per_write"], "store": server_us(w, w["items"])}
    return out


def zero_cost_router_bound(per: dict[str, dict[str, float | None]]) -> float | None:
    """Raw CPU per write over (Locust + store) per write: the router/raw ratio this machine would
    allow if the router cost nothing, everything else unchanged (an estimate from phase averages)."""
    h, raw = per.get("http", {}), per.get("raw", {})
    parts = (h.get("locust"), h.get("store"), raw.get("library"), raw.get("store"))
    if any(p is None for p in parts):
        return None
    locust, store, library, raw_store = (float(p or 0) for p in parts)
    return round((library + raw_store) / (locust + store), 2) if locust + store else None


def _phases(summary: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for group in ("http", "raw", "textbook", "postgres"):
        for part in ("writes", "reads"):
            cpu = summary.get(group, {}).get(part, {}).get("cpu")
            if cpu:
                out.append((f"{group} {part}", cpu))
    cpu = summary.get("http", {}).get("reads_planned", {}).get("cpu")
    if cpu:
        out.append(("http reads, one shard per master", cpu))
    cpu = summary.get("http", {}).get("reads_band", {}).get("cpu")
    if cpu:
        out.append(("http reads, the band board", cpu))
    for step in summary.get("latency_curve", {}).get("steps", []):
        out.append((f"http writes at {step['share']:.0%} of the sustained maximum", step["cpu"]))
    return out


def _light_name(light: dict[str, Any]) -> str:
    """The name of one of the light client's maximums (``light_client``, or its ``batched``)."""
    matches = light.get("matches_per_request", 1)
    return "the router's own maximum" + ("" if matches == 1 else f", {matches} matches a request")


def failed_shares(summary: dict[str, Any]) -> dict[str, float]:
    """Phases where more than FAILED_SHARE of the requests (HTTP) or calls (drivers) failed, with
    that share. Locust counts a failed request among its requests; the light client and the
    drivers count the ones that succeeded (``requests``, ``ops``) apart from the failed ones."""
    counts: list[tuple[str, float, float]] = []  # (phase, failed, attempted)
    http = summary.get("http", {})
    post = http.get("writes", {}).get("endpoints", {}).get(f"POST {POST_NAME}")
    if post:
        counts.append(("http writes", post["failures"], post["requests"]))
    for part, name in (
        ("reads", "http reads"),
        ("reads_planned", "http reads, one shard per master"),
        ("reads_band", "http reads, the band board"),
    ):
        total = http.get(part, {}).get("endpoints", {}).get("Aggregated")
        if total:
            counts.append((name, total["failures"], total["requests"]))
    for step in summary.get("latency_curve", {}).get("steps", []):
        name = f"http writes at {step['share']:.0%} of the sustained maximum"
        counts.append((name, step.get("failures", 0), step.get("requests", 0)))
    light = summary.get("light_client", {})
    for run in (light, light.get("batched", {})):
        if run and "skipped" not in run:
            failures = run.get("failures") or 0
            counts.append((_light_name(run), failures, (run.get("requests") or 0) + failures))
    for group in ("raw", "textbook", "postgres"):
        for part in ("writes", "reads"):
            phase = summary.get(group, {}).get(part)
            if phase:
                counts.append((f"{group} {part}", phase["errors"], phase["ops"] + phase["errors"]))
    for row in summary.get("hot", {}).get("targets", []):  # wrk: a socket error is no answer
        errors = row.get("socket_errors", 0)
        counts.append((f"hot reads: {row['name']}", row.get("non_2xx", 0) + errors, row["requests"] + errors))
    return {
        name: round(failed / attempted, 3)
        for name, failed, attempted in counts
        if attempted and failed / attempted > FAILED_SHARE
    }


def contaminated(summary: dict[str, Any]) -> dict[str, float]:
    """Phases during which processes outside the bench used more than OTHER_LOAD cores on average."""
    return {
        name: round(cpu["other_cpu_s"] / cpu["wall_s"], 2)
        for name, cpu in _phases(summary)
        if cpu.get("wall_s") and cpu.get("other_cpu_s", 0) / cpu["wall_s"] > OTHER_LOAD
    }


def stolen(summary: dict[str, Any]) -> dict[str, float]:
    """Phases during which the hypervisor gave other guests more than STOLEN cores on average (the
    steal time of /proc/stat): CPU the phase wanted and no process of this machine got."""
    return {
        name: round(cpu["steal_cpu_s"] / cpu["wall_s"], 2)
        for name, cpu in _phases(summary)
        if cpu.get("wall_s") and cpu.get("steal_cpu_s", 0) / cpu["wall_s"] > STOLEN
    }


# ---- markdown ------------------------------------------------------------------------------------


def _ms(value: Any) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:g}"


def _rate(value: Any) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _lat(lat: dict[str, Any]) -> str:
    return f"{_ms(lat.get('p50'))} / {_ms(lat.get('p95'))} / {_ms(lat.get('p99'))}" if lat else "-"


def server_us(phase: dict[str, Any], count: float) -> float | None:
    """Store-side CPU µs per operation: Redis masters + replicas, or PostgreSQL's processes."""
    cpu = phase.get("cpu", {}).get("cpu_s", {})
    used = [cpu[k] for k in ("redis masters", "redis replicas", "postgres") if k in cpu]
    return round(sum(used) / count * 1e6, 1) if used and count else None


def _phase_row(name: str, phases: dict[str, Any], write_kind: str) -> str:
    if "skipped" in phases:
        return f"| {name} | skipped: {phases['skipped']} | | | | | | |"
    w, r = phases.get("writes", {}), phases.get("reads", {})
    read_p99 = max((v["p99"] for v in r.get("latency_ms", {}).values()), default=None)
    return (
        f"| {name} | {_rate(w.get('items_per_s'))} | {_lat(w.get('latency_ms', {}).get(write_kind, {}))} "
        f"| {_ms(server_us(w, w.get('items', 0)))} | {_rate(r.get('items_per_s'))} | {_ms(read_p99)} "
        f"| {_ms(server_us(r, r.get('ops', 0)))} | {w.get('errors', 0) + r.get('errors', 0)} |"
    )


def _cpu_row(name: str, cpu: dict[str, Any] | None) -> str:
    if not cpu:
        return f"| {name} | - | - | - | - | - | - | - | - | - | - |"
    c = cpu["cpu_s"]
    return (
        f"| {name} | {cpu['wall_s']} | {c.get('router', '-')} | {c.get('redis masters', '-')} "
        f"| {c.get('redis replicas', '-')} | {c.get('postgres', '-')} | {c.get('locust', '-')} "
        f"| {c.get('driver', '-')} | {cpu.get('other_cpu_s', '-')} | {cpu.get('steal_cpu_s', '-')} "
        f"| {cpu['machine_cpu_s']} |"
    )


def markdown(summary: dict[str, Any], name: str) -> str:
    """summary.md: the contenders side by side, then the HTTP ramp, CPU per phase, sweeps and costs."""
    return "\n".join(
        [
            *_overview(summary, name),
            *_contenders(summary),
            *_goals(summary),
            *read_goals.markdown(summary),
            *_http_details(summary.get("http", {})),
            *_latency_curve(summary),
            *_band_writes(summary.get("http", {}).get("writes_band", {})),
            *_cpu_table(summary),
            *_sweeps(summary.get("sweeps", {})),
            *durability_report.markdown(summary),
            *_costs_measured(summary),
        ]
    )


def _band_writes(w: dict[str, Any]) -> list[str]:
    """The write step on the board of one shard per master and on the band board (run.band_writes)."""
    if not w:
        return []
    if "skipped" in w:
        return [f"Band board writes: skipped ({w['skipped']}).", ""]
    lines = [
        "## HTTP writes: the board of one shard per master and the band board",
        "",
        f"One write step each at {w['offered']:,} writes/s offered (past the ramp's sustained maximum), "
        "a fresh router of the run's processes, the same players; CPU per player-score write.",
        "",
        "| board | writes/s | POST p99 ms | router µs/write | store µs/write | failures |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for part in ("hash", "band"):
        r = w.get(part)
        if r:
            lines.append(
                f"| `{r['board']}` ({part}) | {_rate(r['writes_per_s'])} | {_ms(r.get('p99_ms'))} "
                f"| {r.get('router_us_per_write')} | {r.get('store_us_per_write')} | {r.get('failures', 0)} |"
            )
    return [*lines, ""]


def _overview(summary: dict[str, Any], name: str) -> list[str]:
    m, s = summary["machine"], summary["settings"]
    lines = [
        f"# shardlb bench {name}",
        "",
        f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['memory_gb']} GB, Linux {m['kernel']}, "
        f"Python {m['python']}, {m['redis']}. Everything (cluster, router, Locust, drivers, PostgreSQL) "
        "shares these cores, so every figure below is one slice of the same two cores.",
        f"Cluster: {s['masters']} masters x {s['replicas']} replica; board of {s['shards']} hash shards; "
        f"{summary.get('population', {}).get('players', 0):,} players preloaded; "
        f"{summary['workload']['players_per_match']} players per match; run took {summary.get('seconds')} s.",
        "",
    ]
    if summary.get("contaminated"):
        lines += [
            "**Other load on the machine** (cores used by processes outside the bench, on average): "
            + ", ".join(f"{k} {v}" for k, v in summary["contaminated"].items())
            + ". Those phases had less than the whole machine; compare their figures with care.",
            "",
        ]
    if summary.get("failed"):
        lines += [
            "**Failed requests** (share of each phase's requests or calls that failed): "
            + ", ".join(f"{k} {v:g}" for k, v in summary["failed"].items())
            + f". Above {FAILED_SHARE:.0%}, a phase's rates count only what succeeded of a load the "
            "service partly refused: no goal is met on it.",
            "",
        ]
    if summary.get("stolen"):
        lines += [
            "**CPU stolen by the hypervisor** (cores given to other guests while this machine wanted "
            "them, on average): "
            + ", ".join(f"{k} {v}" for k, v in summary["stolen"].items())
            + ". Those phases had less than the whole machine; compare their figures with care.",
            "",
        ]
    return lines


def _contenders(summary: dict[str, Any]) -> list[str]:
    return [
        "## Writes and reads, same run, same data",
        "",
        "| contender | writes/s | write latency p50 / p95 / p99 ms | store CPU µs/write | reads/s "
        "| worst read p99 ms | store CPU µs/read | errors |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
        _http_row(summary),
        *_planned_row(summary.get("http", {})),
        *_planned_row(summary.get("http", {}), "reads_band"),
        _phase_row("raw limit: library straight at the cluster", summary.get("raw", {}), "write batch"),
        _phase_row("textbook: one sorted set, one Lua call per write", summary.get("textbook", {}), "write"),
        _phase_row("PostgreSQL: indexed table, COUNT(*) rank", summary.get("postgres", {}), "write match"),
        "",
        "Store CPU is what the Redis masters and replicas (or PostgreSQL) spent per operation: the cost "
        "of each design on the server side, whatever the client could drive. "
        "Write latency is per HTTP request for the router, per batch of "
        f"{summary['settings']['batch_matches']} matches for the raw limit, per score for the textbook, "
        "per match for PostgreSQL. "
        "The raw writes go to a twin of the board, loaded with the same players, and stop at "
        f"{_raw_scores(summary)}: the same number of fresh results onto the same state as the HTTP ramp "
        "(a `best` board's write costs the store less once its players' bests have risen)."
        + _postgres_mix(summary),
        "",
    ]


def _postgres_mix(summary: dict[str, Any]) -> str:
    """What PostgreSQL's reads leave out of the mix (bench/peers.py pg_reads reads the top-100 and
    "my rank" alone), when its reads ran and the mix has more."""
    kinds = sorted(summary.get("postgres", {}).get("reads", {}).get("latency_ms", {}))
    mix = summary.get("workload", {}).get("read_mix") or {}
    if not kinds or not mix or set(mix) <= set(kinds):
        return ""
    share = sum(mix.get(k, 0) for k in kinds) / sum(mix.values())
    return (
        f" PostgreSQL's reads are the mix's {' and '.join(kinds)} reads alone ({share:.0%} of the mix, in "
        "their proportion): its reads/s and store CPU per read are not the whole mix's."
    )


def _raw_scores(summary: dict[str, Any]) -> str:
    ramp = summary.get("http", {}).get("writes", {}).get("scores_written")
    raw = summary.get("raw", {}).get("writes", {}).get("items", 0)
    bound = f"{summary['settings']['raw_seconds']:.0f} s"
    if not ramp:
        return f"{bound} (no HTTP ramp in this run; {raw:,} written)"
    return f"the {ramp:,} player-scores the ramp wrote or after {bound} ({raw:,} written)"


def _routers(http: dict[str, Any]) -> str:
    """How many router processes served the writes and the reads (runs before write_workers: both)."""
    writes, reads = http.get("router_workers"), http.get("read_router_workers")
    if reads is None or reads == writes:
        return f"{writes} router processes"
    return f"{writes} router process{'' if writes == 1 else 'es'} for writes, {reads} for reads"


def _http_row(summary: dict[str, Any]) -> str:
    http = summary.get("http", {})
    if "skipped" in http:
        return f"| shardlb over HTTP | skipped: {http['skipped']} | | | | | | |"
    w, r = http.get("writes", {}), http.get("reads", {})
    post = w.get("endpoints", {}).get(f"POST {POST_NAME}", {})
    read_p99 = max((v["p99"] for k, v in r.get("endpoints", {}).items() if k != "Aggregated"), default=None)
    return (
        f"| shardlb over HTTP ({_routers(http)}; board of {summary['settings']['shards']} shards) "
        f"| {_rate(w.get('sustained_writes_per_s'))} | {_lat(post)} (per request of "
        f"{summary['workload']['players_per_match']}) | {_ms(server_us(w, w.get('scores_written', 0)))} "
        f"| {_rate(r.get('reads_per_s'))} | {_ms(read_p99)} | {_ms(server_us(r, _http_read_count(r)))} "
        f"| {w.get('failures', 0) + r.get('failures', 0)} |"
    )


def _planned_row(http: dict[str, Any], part: str = "reads_planned") -> list[str]:
    """The read mix on the board of one shard per master (or on the band board), when the run had it."""
    r = http.get(part)
    banded = part == "reads_band"
    name = "shardlb over HTTP, reads on " + (
        "a band board of one band per master" if banded else "a board of one shard per master"
    )
    if not r:
        return []
    if "skipped" in r:
        return [f"| {name} | skipped: {r['skipped']} | | | | | | |"]
    read_p99 = max((v["p99"] for k, v in r.get("endpoints", {}).items() if k != "Aggregated"), default=None)
    layout = f"{r['shards']} home shards, bands from {r['bands']}" if banded else f"{r['shards']} shards"
    return [
        f"| {name} (`{r['board']}`, {layout}) | - | - | - | {_rate(r.get('reads_per_s'))} "
        f"| {_ms(read_p99)} | {_ms(server_us(r, _http_read_count(r)))} | {r.get('failures', 0)} |"
    ]


def _goals(summary: dict[str, Any]) -> list[str]:
    ratios, goal = summary.get("ratios", {}), summary["goal"]
    lines = [
        f"- router / raw limit, writes: **{_ms(ratios.get('router_over_raw_writes'))}**; reads: "
        f"**{_ms(ratios.get('router_over_raw_reads'))}** (goal: writes >= {goal['router_over_raw']}: "
        f"{'met' if goal.get('ratio_met') else 'not met'})",
        f"- goal {goal['writes_per_s']:,} player-score writes/s through HTTP: "
        f"{'met' if goal.get('writes_met') else 'not met'} on this machine",
    ]
    light = summary.get("light_client", {})
    if light and "skipped" not in light:
        lines.append(
            f"- the router's own maximum, driven by a light client (bench/pacer.py: {light['users']} "
            f"connections posting back to back) instead of Locust, through {light['router_workers']} "
            f"router process(es): {_at_maximum(light, goal)}" + _collections(light.get("gc"))
        )
        batched = light.get("batched", {})
        if batched and "skipped" not in batched:
            lines.append(
                f"- the same with {batched['matches_per_request']} matches ({batched['scores_per_request']} "
                f"scores) a request from {batched['users']} connections: {_at_maximum(batched, goal)}"
            )
    per = summary.get("cpu_per_write", {})
    if "http" in per and "raw" in per:
        h, raw = per["http"], per["raw"]
        line = (
            f"- CPU per player-score write, whole machine (phase averages): HTTP = router {_ms(h['router'])}"
            f" + Locust {_ms(h['locust'])} + store {_ms(h['store'])} µs; raw = library "
            f"{_ms(raw['library'])} + store {_ms(raw['store'])} µs."
        )
        bound = zero_cost_router_bound(per)
        if bound is not None:
            line += (
                " Every process shares the same cores: with Locust and the store alone, router/raw "
                f"would be about {bound:.2f} even for a router that cost nothing."
            )
        lines.append(line)
    return [*lines, ""]


def _http_details(http: dict[str, Any]) -> list[str]:
    """The write ramp step by step, whether Locust was the limit, and every endpoint's figures."""
    if "writes" not in http:
        return []
    w = http["writes"]
    lines = [
        "## HTTP write ramp",
        "",
        "| until s | users | offered writes/s | achieved | p99 ms (recent) |",
        "|---:|---:|---:|---:|---:|",
        *(
            f"| {st['until_s']:g} | {st['users']} | {st['offered']:,} | {st['achieved']:,} "
            f"| {_ms(st['p99_ms'])} |"
            for st in w["steps"]
        ),
        "",
        f"Locust CPU-bound: {'YES' if w['locust_cpu_bound'] else 'no'} "
        f"(busiest Locust process {w['cpu']['busiest_process_share'].get('locust')} of a core)"
        + (f"; warnings: {'; '.join(w['locust_warnings'])}" if w["locust_warnings"] else ""),
        "",
        "## HTTP endpoints",
        "",
        "| endpoint | requests | failures | req/s | p50 | p95 | p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    planned, banded = http.get("reads_planned", {}), http.get("reads_band", {})
    for part, where in (
        ("writes", ""),
        ("reads", ""),
        ("reads_planned", f" (`{planned.get('board')}`)"),
        ("reads_band", f" (`{banded.get('board')}`)"),
    ):
        for key, e in http.get(part, {}).get("endpoints", {}).items():
            if key != "Aggregated":
                lines.append(
                    f"| {key}{where} | {e['requests']:,} | {e['failures']} | {e['rps']} | {_ms(e['p50'])} "
                    f"| {_ms(e['p95'])} | {_ms(e['p99'])} |"
                )
    return [*lines, ""]


def _latency_curve(summary: dict[str, Any]) -> list[str]:
    """The constant-rate write steps at shares of the ramp's sustained maximum (run.latency_curve)."""
    curve = summary.get("latency_curve")
    if not curve:
        return []
    title = "## HTTP write latency at shares of the sustained maximum"
    if "skipped" in curve:
        return [title, "", f"Skipped: {curve['skipped']}.", ""]
    lines = [
        f"{title} ({_rate(curve['sustained_writes_per_s'])} writes/s in the ramp)",
        "",
        "| share | users | offered writes/s | achieved | POST p50 / p95 / p99 ms (Locust) "
        "| the router's own p50 / p95 / p99 ms | requests | failures | Locust CPU-bound "
        "| light paced client: p50 / p95 / p99 ms, requests/s, failures, its CPU s "
        "| the router's own under it: p50 / p95 / p99 ms |",
        "|---:|---:|---:|---:|---|---|---:|---:|---|---|---|",
        *(
            f"| {st['share']:.0%} | {st['users']} | {_rate(st['offered'])} | {_rate(st['achieved'])} "
            f"| {_ms(st['p50_ms'])} / {_ms(st['p95_ms'])} / {_ms(st['p99_ms'])} | {_own(st)} "
            f"| {st['requests']:,} | {st['failures']} | {'YES' if st['locust_cpu_bound'] else 'no'} "
            f"| {_paced(st)} | {_own(st.get('paced') or {})} |"
            for st in curve["steps"]
        ),
        "",
        f"Each step is a fresh router of {curve['router_workers']} processes under Locust's `soak` shape: "
        f"{_ms(curve['seconds'])} s, the first {_ms(curve['held_from_s'])} s at half the rate, then the "
        "offered rate held. Achieved is over the held part (its first "
        f"{SPAWN_SETTLE_S:g} s left out); the percentiles are Locust's over the step's last "
        f"{locust_csv.RECENT_WINDOW_S:g} s, per POST of {summary['workload']['players_per_match']} scores. "
        "They are measured by Locust, so they include Locust's own scheduling (its event loop and its "
        "processes waiting for a core) on the same two shared cores as the router and Redis. The "
        "router's own figures come from its latency "
        "histogram (bench/server_latency.py: from the app receiving the request to the response "
        "handed back, scraped about the same window, interpolated inside its buckets): they leave "
        "out the client's waits, not the router's. Issue 13's goal, write p99 under 50 ms at 80% of "
        "the sustained maximum, is read from the 80% step (Locust's figure).",
        "",
        "The light paced client (bench/pacer.py) offers each step's load again, through another fresh "
        "router: the same users at the same pace on one keep-alive connection each, the same matches "
        "and retries, from one process that writes HTTP by hand. Locust spends about as much CPU per "
        "request as the router, on the same two cores; this client a fraction of it, so its "
        "percentiles (over the same window at the end of the step) are closer to what the service "
        "itself gives; the router's own histogram under it is scraped over the same window. "
        '"p99 from n 100-ms slots": the requests at or above the client\'s p99 started in n of the '
        "window's hundred 100-ms slots; a few say that one stall of the router or the machine set "
        'the p99 (bench/README.md, "Where the write p99 at 80% comes from"). "Router waited": '
        "the milliseconds a second its threads were ready to run and waited for a core over the "
        "window (/proc schedstat).",
        "",
    ]
    profiled = [
        {"name": f"router score writes, {st['share']:.0%} step", "profile": st["profile"]}
        for st in curve["steps"]
        if st.get("profile")
    ]
    return lines + read_goals.profiles(
        profiled, "one router worker while the step held its rate (the 80% step is not sampled)"
    )


def _at_maximum(run: dict[str, Any], goal: dict[str, Any]) -> str:
    """One of the light client's maximums: its rate, latency, failures and CPU per write, and
    whether it reaches the write goal."""
    failures = run.get("failures") or 0
    attempted = (run.get("requests") or 0) + failures
    refused = bool(attempted) and failures / attempted > FAILED_SHARE
    reached = run["writes_per_s"] >= goal["writes_per_s"] and not refused
    return (
        f"**{run['writes_per_s']:,}** writes/s, p50 / p99 {_ms(run.get('p50_ms'))} / "
        f"{_ms(run.get('p99_ms'))} ms per request, {run.get('failures', 0)} failures; CPU µs per write: "
        f"router {_ms(run.get('router_us'))}, store {_ms(run.get('store_us'))}, client "
        f"{_ms(run.get('client_us'))} (goal {goal['writes_per_s']:,}: {'met' if reached else 'not met'})"
    )


def _collections(gc: dict[str, Any] | None) -> str:
    """The router's garbage collections over a metered window (router/heap.py), when scraped."""
    if not gc:
        return ""
    collections, pauses = gc["collections"], gc["pause_ms"]
    return f"; the router's garbage collections in that window: {collections}, {pauses:g} ms of pauses"


def _paced(step: dict[str, Any]) -> str:
    """The light paced client's cell of a latency step: its percentiles, rate, failures and CPU."""
    paced = step.get("paced")
    if not paced:
        return "-"
    if "skipped" in paced:
        return f"skipped: {paced['skipped']}"
    return (
        f"{_ms(paced['p50_ms'])} / {_ms(paced['p95_ms'])} / {_ms(paced['p99_ms'])}, "
        f"{paced['requests_per_s']:,.0f}/s, {paced['failures']}, {paced['client_cpu_s']:g}"
    ) + read_goals.stall_note(paced)


def _own(step: dict[str, Any]) -> str:
    """The router's own percentiles of a latency step, or a dash when they were not scraped."""
    own = step.get("router") or {}
    if own.get("p99_ms") is None:
        return "-"
    return f"{_ms(own['p50_ms'])} / {_ms(own['p95_ms'])} / {_ms(own['p99_ms'])}"


def _cpu_table(summary: dict[str, Any]) -> list[str]:
    http = summary.get("http", {})
    planned = http.get("reads_planned", {})
    return [
        "## CPU seconds per phase",
        "",
        "| phase | wall s | router | Redis masters | Redis replicas | PostgreSQL | Locust | driver | other "
        "| stolen | whole machine |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        _cpu_row("HTTP writes", http.get("writes", {}).get("cpu")),
        _cpu_row("HTTP reads", http.get("reads", {}).get("cpu")),
        *([_cpu_row(f"HTTP reads, `{planned['board']}`", planned.get("cpu"))] if "board" in planned else []),
        *(
            [_cpu_row(f"HTTP reads, `{banded['board']}`", banded.get("cpu"))]
            if "board" in (banded := http.get("reads_band", {}))
            else []
        ),
        *(
            _cpu_row(f"HTTP writes at {st['share']:.0%}", st.get("cpu"))
            for st in summary.get("latency_curve", {}).get("steps", [])
        ),
        *(
            _cpu_row(f"{group} {part}", summary.get(group, {}).get(part, {}).get("cpu"))
            for group in ("raw", "textbook", "postgres")
            for part in ("writes", "reads")
        ),
        "",
        "CPU seconds over the phase (driver phases: wall includes ~3 s of driver start-up). "
        "`other` is CPU that none of these processes spent: anything else running on the machine. "
        "`stolen` is the time the hypervisor gave other guests while a core here wanted it (steal in "
        "/proc/stat): no process here spent it, and the whole machine's figure leaves it out. "
        "A process near 1 CPU second per second was itself a limit of its phase.",
        "",
    ]


def _sweeps(sweeps: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if sweeps.get("masters"):
        lines += [
            "## Sweep: cluster masters (raw writes)",
            "",
            "| masters | writes/s | p99 ms per batch | failed batches |",
            "|---:|---:|---:|---:|",
            *(
                f"| {p['masters']} | {_rate(p['writes_per_s'])} | {_ms(p['p99_ms'])} | {p.get('errors', 0)} |"
                for p in sweeps["masters"]
            ),
            "",
        ]
    if sweeps.get("routers"):
        lines += [
            f"## Sweep: router processes (HTTP writes, {_rate(sweeps.get('router_offered_writes'))} offered)",
            "",
            "| router processes | writes/s | p99 ms | router CPU µs/write | store CPU µs/write | failures |",
            "|---:|---:|---:|---:|---:|---:|",
            *(
                f"| {p['router_workers']} | {_rate(p['writes_per_s'])} | {_ms(p['p99_ms'])} "
                f"| {_sweep_cpu(p, 'router')} | {_sweep_cpu(p, 'redis masters', 'redis replicas')} "
                f"| {p.get('failures', 0)} |"
                for p in sweeps["routers"]
            ),
            "",
            "Each worker coalesces its own requests: with more workers on the same cores, each sends "
            'smaller script calls (router/README.md, "Workers and batches").',
            "",
        ]
    return lines


def _sweep_cpu(point: dict[str, Any], *groups: str) -> str:
    """CPU µs per player-score write of ``groups`` over a sweep step ('-' when not metered)."""
    cpu, n = point.get("cpu", {}).get("cpu_s", {}), point.get("scores_written") or 0
    if not n or not any(g in cpu for g in groups):
        return "-"
    return f"{sum(cpu.get(g, 0.0) for g in groups) / n * 1e6:.1f}"


def _costs_measured(summary: dict[str, Any]) -> list[str]:
    pop = summary.get("population", {})
    return [
        "## Costs measured (what `shardlb plan` sizes from)",
        "",
        *(f"- {k}: {_ms(v)}" for k, v in summary.get("costs", {}).items()),
        "",
        f"Preload: board {pop.get('board_load_s')} s, textbook {pop.get('textbook_load_s')} s, "
        f"PostgreSQL {summary.get('postgres_load')}.",
        "",
    ]


def plots(summary: dict[str, Any], out: Path) -> list[Path]:
    from bench import plots as plotting

    return plotting.sweeps(summary, out)
