"""Issue 13's goals, computed from one run's summary: each measured ratio beside its goal, reported
and never asserted (bench/README.md, "What each figure means": "issue 13's goals").

``finish`` adds ``summary["read_goals"]`` (a list of goal rows); ``markdown`` renders them and the hot
phase's table (bench/hot.py). A goal whose inputs a run did not measure is listed as not measured.
"""

from __future__ import annotations

import math
from typing import Any

from bench import commandstats

BAND_RANK = "router my rank, band board "  # the hot phase's band board target (bench/hot.py)
KEPT_AGE_MS = 1000  # its "my rank" with max_age_ms: the other bands' sizes up to this old
KEPT_RANK = f"router my rank with max_age_ms={KEPT_AGE_MS}, band board "
# A write step that achieved less than it offered by more than this share was past what the router
# held: its latency is an overload's, not the latency at the share the step was meant to offer.
OVERLOAD_SHORT = 0.02


def _hot(summary: dict[str, Any], prefix: str) -> dict[str, Any] | None:
    rows = summary.get("hot", {}).get("targets", [])
    return next((r for r in rows if r["name"].startswith(prefix)), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    # Kept to 4 places: a goal is judged on this (0.995 is short of 1.0, whatever 2 places show).
    return round(a / b, 4) if a is not None and b else None


def _store_us(phase: dict[str, Any] | None, count: float) -> float | None:
    cpu = (phase or {}).get("cpu", {}).get("cpu_s", {})
    used = [cpu[k] for k in ("redis masters", "redis replicas") if k in cpu]
    return sum(used) / count * 1e6 if used and count else None


def _goal(name: str, measured: float | None, goal: float, at_least: bool, detail: str) -> dict[str, Any]:
    met = None if measured is None else (measured >= goal if at_least else measured <= goal)
    return {
        "goal": name,
        "measured": measured,
        "target": goal,
        "at_least": at_least,
        "met": met,
        "detail": detail,
    }


def short_of_offered(offered: float | None, achieved: float | None) -> float | None:
    """The share of its ``offered`` rate that a step's ``achieved`` rate fell short by, when more
    than OVERLOAD_SHORT (the step was overloaded); else None."""
    if not offered or achieved is None:
        return None
    short = 1 - achieved / offered
    return short if short > OVERLOAD_SHORT else None


def _p99_goal(
    name: str, p99: float, offered: float, achieved: float, figures: tuple[str, str, str]
) -> dict[str, Any]:
    """A write p99 goal read at a step that offered ``offered`` writes/s and achieved ``achieved``,
    its detail from ``figures`` (the rates, the failures, the other notes): met or not when the
    step held its rate; an overloaded step (short_of_offered) reports no p99 and no verdict, but
    the flag, by how much it fell short, and its p99 as past what the router held."""
    rates, failures, notes = figures
    short = short_of_offered(offered, achieved)
    if short is None:
        return _goal(name, p99, 50.0, False, rates + failures + notes)
    detail = (
        f"**overloaded**: {rates} ({short:.1%} short){failures}; its p99 {p99:g} ms is past what the "
        f"router held, not at 80%{notes}"
    )
    return {**_goal(name, None, 50.0, False, detail), "overloaded": True}


def _mix_goals(layout: str, http_reads: dict[str, Any], tb_reads: dict[str, Any]) -> list[dict[str, Any]]:
    """The HTTP read mix on one board layout against the textbook's mix (one sorted set, so the same
    textbook figures serve every layout)."""
    count = http_reads.get("endpoints", {}).get("Aggregated", {}).get("requests", 0)
    ours, theirs = _store_us(http_reads, count), _store_us(tb_reads, tb_reads.get("ops", 0))
    board = f"`{http_reads['board']}`: " if "board" in http_reads else ""
    return [
        _goal(
            f"HTTP reads/s of the mix / the textbook's, {layout}",
            _ratio(http_reads.get("reads_per_s"), tb_reads.get("items_per_s")),
            1.0,
            True,
            f"{board}{http_reads.get('reads_per_s')} against {tb_reads.get('items_per_s')} reads/s",
        ),
        _goal(
            f"store CPU per read of the mix / the textbook's, {layout}",
            _ratio(ours, theirs),
            2.0,
            False,
            f"{board}{ours and round(ours)} against {theirs and round(theirs)} µs",
        ),
    ]


def _band_layout(summary: dict[str, Any]) -> str:
    sharding = summary.get("hot", {}).get("band_sharding", {})
    return f"{sharding.get('shards')} home shards and {len(sharding.get('bands', []))} bands"


def _rank_goals(rank: dict[str, Any], tb_rank: dict[str, Any], layout: str) -> list[dict[str, Any]]:
    """ "My rank" of one router process against the textbook service: requests/s and store CPU."""
    ours = rank["masters_us"] + rank["replicas_us"]
    theirs = tb_rank["masters_us"] + tb_rank["replicas_us"]
    return [
        _goal(
            f"my rank requests/s, {layout}one router process / the textbook service",
            _ratio(rank["rps"], tb_rank["rps"]),
            1.0,
            True,
            f"{rank['name']}: {rank['rps']:.0f} against {tb_rank['rps']:.0f}/s",
        ),
        _goal(
            f"store CPU per my rank{', ' + layout.removesuffix(', ') if layout else ''} / the textbook's",
            _ratio(ours, theirs),
            2.0,
            False,
            f"{ours:.0f} against {theirs:.0f} µs",
        ),
    ]


def goals(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Every goal of issue 13 that this run measured, as ratios of figures of this one run."""
    http, tb_reads = summary.get("http", {}), summary.get("textbook", {}).get("reads", {})
    s, planned = summary.get("settings", {}), http.get("reads_planned", {})
    out = [
        *_mix_goals(f"the bench's board ({s.get('shards')} shards)", http.get("reads", {}), tb_reads),
        *_mix_goals(
            f"one shard per master ({planned.get('shards', s.get('masters'))} shards, the planner's layout)",
            planned,
            tb_reads,
        ),
    ]
    banded = http.get("reads_band", {})
    if banded:
        out += _mix_goals(f"the band board ({_band_layout(summary)})", banded, tb_reads)
    tb_rank = _hot(summary, "textbook my rank")
    for rank, layout in (
        (_hot(summary, "router my rank, "), ""),
        (_hot(summary, BAND_RANK), "band board, "),
        (_hot(summary, KEPT_RANK), f"band board, max_age_ms={KEPT_AGE_MS}, "),
    ):
        if rank is not None and tb_rank is not None:
            out += _rank_goals(rank, tb_rank, layout)
    per = summary.get("cpu_per_write", {})
    h, raw = per.get("http", {}), per.get("raw", {})
    out.append(
        _goal(
            "router CPU per write / the library's in the raw run",
            _ratio(h.get("router"), raw.get("library")),
            1.5,
            False,
            f"{h.get('router')} against {raw.get('library')} µs{_by_processes(summary, ('router',))}",
        )
    )
    out.append(
        _goal(
            "store CPU per write over HTTP / the raw run's",
            _ratio(h.get("store"), raw.get("store")),
            1.1,
            False,
            f"{h.get('store')} against {raw.get('store')} µs"
            f"{_by_processes(summary, ('redis masters', 'redis replicas'))}",
        )
    )
    out += _light_goals(summary.get("light_client", {}), raw)
    top, health = _hot(summary, "router top-100"), _hot(summary, "router /healthz")
    if top is not None and health is not None:
        out.append(
            _goal(
                "cached top-100 requests/s of one router process",
                top["rps"],
                10_000,
                True,
                f"p99 {top.get('p99_ms')} ms (goal under 5 ms)",
            )
        )
        out.append(
            _goal(
                "cached top-100 p99 ms of one router process",
                top.get("p99_ms"),
                5.0,
                False,
                f"{top['rps']:.0f} requests/s",
            )
        )
        out.append(
            _goal(
                "cached top-100 / /healthz of the same router",
                _ratio(top["rps"], health["rps"]),
                0.7,
                True,
                f"{top['rps']:.0f} against {health['rps']:.0f}/s",
            )
        )
    name = "write p99 ms at 80% of the sustained maximum"
    step = latency_step(summary, 0.8)
    if step is not None:
        figures = _curve_figures(summary, step)
        out.append(_p99_goal(name, float(step["p99_ms"]), step["offered"], step["achieved"], figures))
    elif (ramp := write_p99_at(summary, 0.8)) is not None:
        detail = f"ramp step at {ramp[0]:,} writes/s achieved (no latency curve step at 80%)"
        out.append(_goal(name, ramp[1], 50.0, False, detail))
    return out


def _light_goals(light: dict[str, Any], raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The write goals again at the router's own maximum, driven by the light client (bench/run.py
    ``light_client``): its CPU and the store's per write there against the raw run's, and the write
    p99 of paced users at 80% of that maximum; then the same for its maximum with several matches
    a request (``batched``). Nothing for a maximum that did not run."""
    out: list[dict[str, Any]] = []
    for run in (light, light.get("batched")):
        if not run or "skipped" in run:
            break
        size = (
            f", {run['matches_per_request']} matches ({run['scores_per_request']} scores) a request"
            if run.get("matches_per_request", 1) > 1
            else ""
        )
        at = f"at the router's own maximum{size} ({run['writes_per_s']:,} writes/s, light client)"
        out += _cpu_goals(run, raw, at)
        step = run.get("at_80", {})
        if step.get("p99_ms") is not None:
            own = step.get("router", {}).get("p99_ms")
            offered, achieved = step["offered_writes_per_s"], step["achieved_writes_per_s"]
            out.append(
                _p99_goal(
                    f"write p99 ms at 80% of the router's own maximum{size} (light paced client)",
                    float(step["p99_ms"]),
                    offered,
                    achieved,
                    (
                        f"{step['users']} paced users offering {offered:,} writes/s, {achieved:,} achieved",
                        f", {step['failures']} failures",
                        (f"; the router's own p99 {own:g} ms" if own is not None else "") + stall_note(step),
                    ),
                )
            )
    return out


def stall_note(paced: dict[str, Any]) -> str:
    """What a paced step says of its p99's stall, when it has it (runs since 2026-12-06): in how
    many 100-ms slots its slowest requests started, and how long the router waited for a core."""
    note = ""
    slots = paced.get("p99_slots")
    if slots:
        note += f"; p99 from {slots['slots']} 100-ms slot(s)"
    cpu = paced.get("cpu") or {}
    waited, wall = (cpu.get("waited_s") or {}).get("router"), cpu.get("wall_s")
    if waited is not None and wall:
        note += f"; router waited {waited / wall * 1000:,.0f} ms/s for a core"
    return note


def _cpu_goals(light: dict[str, Any], raw: dict[str, Any], at: str) -> list[dict[str, Any]]:
    """The two write CPU goals of one of the light client's maximums, ``at`` naming it."""
    return [
        _goal(
            f"router CPU per write {at} / the library's in the raw run",
            _ratio(light.get("router_us"), raw.get("library")),
            1.5,
            False,
            f"{light.get('router_us')} against {raw.get('library')} µs",
        ),
        _goal(
            f"store CPU per write {at} / the raw run's",
            _ratio(light.get("store_us"), raw.get("store")),
            1.1,
            False,
            f"{light.get('store_us')} against {raw.get('store')} µs",
        ),
    ]


def latency_step(summary: dict[str, Any], share: float) -> dict[str, Any] | None:
    """The latency curve's step at ``share`` of the sustained maximum (bench/run.py), if it ran."""
    steps = summary.get("latency_curve", {}).get("steps", [])
    return next((s for s in steps if math.isclose(s["share"], share)), None)


def _curve_figures(summary: dict[str, Any], step: dict[str, Any]) -> tuple[str, str, str]:
    """What the latency curve's ``step`` measured, for its goal's detail (``_p99_goal``): its
    rates, its failures, and the step's other p99s (the router's own, the light paced client's)."""
    sustained = summary["latency_curve"]["sustained_writes_per_s"]
    own = step.get("router", {}).get("p99_ms")
    paced = step.get("paced", {}).get("p99_ms")
    paced_own = step.get("paced", {}).get("router", {}).get("p99_ms")
    return (
        f"latency curve: constant {step['offered']:,} writes/s offered ({step['share']:.0%} of "
        f"{sustained:,} sustained), {step['achieved']:,} achieved",
        f", {step['failures']} failures",
        (f"; the router's own p99 {own:g} ms" if own is not None else "")
        + (f"; a light paced client's p99 {paced:g} ms (bench/pacer.py)" if paced is not None else "")
        + (f", the router's own under it {paced_own:g} ms" if paced_own is not None else ""),
    )


def write_p99_at(summary: dict[str, Any], share: float) -> tuple[int, float] | None:
    """The ramp step closest below ``share`` of the sustained maximum: (achieved writes/s, p99 ms)."""
    w = summary.get("http", {}).get("writes", {})
    steps, top = w.get("steps", []), w.get("sustained_writes_per_s")
    if not steps or not top:
        return None
    below = [s for s in steps if s["achieved"] <= share * top] or steps[:1]
    step = max(below, key=lambda s: s["achieved"])
    return int(step["achieved"]), float(step["p99_ms"])


def read_costs(summary: dict[str, Any]) -> dict[str, float]:
    """A mix read's Redis CPU on each node it touches, split into a part per node (the round trip)
    and a part per shard the node holds (bench/plan.py's redis_node_us_per_read and
    redis_shard_us_per_read): solved from "my rank" on the two boards of the hot phase (one shard
    per master, and the bench's shards), then scaled to the cost of a read of the mix that is not
    a cached top, on the bench's board: the HTTP mix's masters' CPU per read, over the share of its
    reads that are not tops (the routers answer those from RAM; bench/plan.py takes that share off
    again with ``cached``). Until 2026-12-05 it was scaled to the raw library's mix, whose tops are
    not cached, so the plan counted the tops' saving twice: 21% less Redis CPU per read than the
    bench measured over HTTP. The raw mix stands in when the run has no HTTP mix. Empty when the
    run lacks either "my rank"."""
    s, hot = summary.get("settings", {}), summary.get("hot", {})
    few, many = _hot(summary, f"router my rank, {hot.get('hot_board')}"), None
    for r in hot.get("targets", []):
        if (
            r["name"].startswith("router my rank, ")
            and r is not few
            and "replicas" not in r["name"]
            and not r["name"].startswith(BAND_RANK)
        ):
            many = r
    raw = summary.get("raw", {}).get("reads", {})
    masters, shards = s.get("masters"), s.get("shards")
    if few is None or many is None or not raw or not masters or shards == hot.get("hot_board_shards"):
        return {}
    k_few, k_many = hot["hot_board_shards"] / masters, shards / masters
    n_few, n_many = few["masters_us"] / masters, many["masters_us"] / masters
    per_shard = max(0.0, (n_many - n_few) / (k_many - k_few))
    per_node = max(0.0, n_few - k_few * per_shard)
    http = summary.get("http", {}).get("reads", {})
    requests = http.get("endpoints", {}).get("Aggregated", {}).get("requests")
    mixed = summary.get("workload", {}).get("read_mix") or {}
    uncached = 1 - (mixed.get("top", 0) / sum(mixed.values()) if mixed else 0.0)
    if requests and uncached > 0 and "redis masters" in http.get("cpu", {}).get("cpu_s", {}):
        mix = http["cpu"]["cpu_s"]["redis masters"] / requests * 1e6 / masters / uncached
    elif raw.get("ops"):
        mix = raw["cpu"]["cpu_s"].get("redis masters", 0.0) / raw["ops"] * 1e6 / masters
    else:
        mix = 0.0
    scale = mix / n_many if n_many else 0.0
    return {
        "redis_node_us_per_read": round(per_node * scale, 1),
        "redis_shard_us_per_read": round(per_shard * scale, 1),
    }


def finish(summary: dict[str, Any]) -> None:
    summary["read_goals"] = goals(summary)


def _value(x: float | None, target: float | None = None) -> str:
    """``x`` for the goals table: 2 places, or 3 where 2 would show it equal to ``target``."""
    if x is None:
        return "not measured"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if target is not None and x != target and f"{x:.2f}" == f"{target:.2f}":
        return f"{x:.3f}"
    return f"{x:.2f}"


def markdown(summary: dict[str, Any]) -> list[str]:
    rows = summary.get("read_goals") or goals(summary)
    lines = [
        "## Reads and hot paths: issue 13's goals (ratios of this run)",
        "",
        "| goal | measured | target | met | figures |",
        "|---|---:|---:|---|---|",
    ]
    for g in rows:
        met = "-" if g["met"] is None else ("yes" if g["met"] else "**no**")
        sign = ">=" if g["at_least"] else "<="
        value = "overloaded" if g.get("overloaded") else _value(g["measured"], g["target"])
        lines.append(f"| {g['goal']} | {value} | {sign} {_value(g['target'])} | {met} | {g['detail']} |")
    light = summary.get("light_client", {})
    at_max = (
        profiles(
            [{"name": "router score writes at the router's own maximum", "profile": light["profile"]}],
            "one router worker under the light client's load, offered again after the metered window",
        )
        if light.get("profile")
        else []
    )
    return [*lines, "", *store_profiles(summary), *mix_profiles(summary), *at_max, *hot_table(summary)]


# The HTTP read mixes (summary["http"] keys) and the layout each is read on.
MIXES = (
    ("reads", "the bench's board"),
    ("reads_planned", "one shard per master"),
    ("reads_band", "the band board"),
)


def mix_profiles(summary: dict[str, Any]) -> list[str]:
    """Where a router worker's CPU went under each read mix whose reads/s is short of the textbook's
    (sampled while the mix's users read again after its metered window: bench/run.py
    ``_profiled_reads``). The store's side of the same mixes is in ``store_profiles``."""
    http = summary.get("http", {})
    theirs = summary.get("textbook", {}).get("reads", {}).get("items_per_s")
    rows = []
    for key, layout in MIXES:
        mix = http.get(key) or {}
        ratio = _ratio(mix.get("reads_per_s"), theirs)
        if mix.get("profile") and (ratio is None or ratio < 1.0):
            board = f" (`{mix['board']}`)" if "board" in mix else ""
            rows.append({"name": f"router under the read mix, {layout}{board}", "profile": mix["profile"]})
    return profiles(rows, "one router worker under the same read mix, offered again after the metered window")


def store_profiles(summary: dict[str, Any]) -> list[str]:
    """Where the store's time went in the phases behind the store CPU goals (per read of the mix and
    per player-score write, HTTP beside the raw library and the textbook): INFO commandstats over
    each phase, masters and replicas (bench/commandstats.py)."""
    http, raw, textbook = (summary.get(k, {}) for k in ("http", "raw", "textbook"))

    def column(name: str, phase: dict[str, Any] | None, ops: float) -> tuple[str, Any, float, float | None]:
        phase = phase or {}
        commands = phase.get("cpu", {}).get("commands")
        cpu = phase.get("cpu", {}).get("cpu_s", {})
        store = cpu.get("redis masters", 0.0) + cpu.get("redis replicas", 0.0)
        return name, commands, ops, store / ops * 1e6 if commands and ops else None

    reads = [
        column(
            "HTTP, 16 shards" if "reads" in http else "HTTP", http.get("reads"), _reads(http.get("reads"))
        ),
        column("HTTP, one shard per master", http.get("reads_planned"), _reads(http.get("reads_planned"))),
        column("HTTP, band board", http.get("reads_band"), _reads(http.get("reads_band"))),
        column("raw library", raw.get("reads"), (raw.get("reads") or {}).get("items", 0)),
        column("textbook", textbook.get("reads"), (textbook.get("reads") or {}).get("items", 0)),
    ]
    writes = [
        column("HTTP (ramp)", http.get("writes"), (http.get("writes") or {}).get("scores_written", 0)),
        column("raw library", raw.get("writes"), (raw.get("writes") or {}).get("items", 0)),
        column("textbook", textbook.get("writes"), (textbook.get("writes") or {}).get("items", 0)),
    ]
    lines: list[str] = []
    for title, columns in (("per read of the mix", reads), ("per player-score write", writes)):
        table = commandstats.profile_lines(columns)
        if table:
            lines += [
                f"#### Profile: the store {title} (INFO commandstats, masters and replicas)",
                "",
                *table,
                "",
            ]
    if lines:
        lines += [
            "A script's row includes the commands it calls, which Redis also counts under their own "
            "names. Redis times a command by the clock: a command whose node lost its core midway "
            "counts the wait too, so on shared cores a long script's time can pass the store CPU "
            "from /proc. Compare the columns with each other: calls per operation are exact, times "
            "are shares.",
            "",
        ]
    return lines


def _reads(phase: dict[str, Any] | None) -> int:
    count: int = (phase or {}).get("endpoints", {}).get("Aggregated", {}).get("requests", 0)
    return count


def hot_table(summary: dict[str, Any]) -> list[str]:
    hot = summary.get("hot", {})
    if "skipped" in hot:
        return [f"Hot reads: skipped ({hot['skipped']}).", ""]
    if not hot.get("targets"):
        return []
    lines = [
        "### Hot reads, one server process each (wrk, "
        f"{hot['connections']} connections, {hot['seconds_per_target']:.0f} s per target"
        + (
            f" in {hot['rounds']} rounds, the servers side by side and the targets taking turns)"
            if hot.get("rounds", 1) > 1
            else ")"
        ),
        "",
        f"`{hot['hot_board']}`: {hot['hot_board_shards']} shards, one per master (the layout `shardlb plan` "
        "recommends); the bench's board has the shards of the run's settings. CPU µs per request.",
        "",
        "| target | requests/s | p50 ms | p99 ms | server µs | masters µs | replicas µs | non-2xx |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in hot["targets"]:
        lines.append(
            f"| {r['name']} | {r['rps']:,.0f} | {r.get('p50_ms', '-')} | {r.get('p99_ms', '-')} "
            f"| {r['server_us']} | {r['masters_us']} | {r['replicas_us']} "
            f"| {r['non_2xx'] + r['socket_errors']} |"
        )
    return [*lines, "", *profiles(hot["targets"])]


def profiles(
    rows: list[dict[str, Any]], sampled: str = "the router process under the same load"
) -> list[str]:
    """Where the router's CPU went on the targets short of their goals (py-spy, bench/hot.py)."""
    lines: list[str] = []
    for r in rows:
        p = r.get("profile")
        if not p:
            continue
        lines += [f"#### Profile: {r['name']}", ""]
        if "skipped" in p:
            lines += [f"Not profiled: {p['skipped']}.", ""]
            continue
        lines += [
            f"py-spy, {p['samples']} samples of {sampled}: the functions "
            "with the most samples of their own, and the project's functions with their callees.",
            "",
            "| own time | % | with callees (router/, shardlb/) | % |",
            "|---|---:|---|---:|",
        ]
        own, within = p["self"], p["inclusive"]
        for i in range(max(len(own), len(within))):
            a = own[i] if i < len(own) else ("", "")
            b = within[i] if i < len(within) else ("", "")
            lines.append(f"| `{a[0]}` | {a[1]} | `{b[0]}` | {b[1]} |")
        lines.append("")
    return lines


def _by_processes(summary: dict[str, Any], groups: tuple[str, ...]) -> str:
    """The ramp's router process count and the router sweep's CPU per write of ``groups`` at each
    count: a router process batches its own requests, so the count moves both write costs."""
    workers = summary.get("http", {}).get("router_workers")
    points = []
    for p in summary.get("sweeps", {}).get("routers", []):
        cpu, n = p.get("cpu", {}).get("cpu_s", {}), p.get("scores_written") or 0
        if n and any(g in cpu for g in groups):
            points.append(f"{p['router_workers']}: {sum(cpu.get(g, 0.0) for g in groups) / n * 1e6:.1f}")
    sweep = f"; the router sweep, by processes: {', '.join(points)} µs" if points else ""
    return f" (ramp through {workers} router process{'' if workers == 1 else 'es'}{sweep})" if workers else ""
