"""The durability phases (bench/durability.py) as figures and text: writes/s with the journal and
the archiver on beside off, and with replica acknowledgement beside primary, what each costs per
write in every process, how far the archive lagged, and the journal's memory per result.

The goal (reported, never asserted): the journal costs under GOAL_COST of write throughput.
"""

from __future__ import annotations

from typing import Any

GOAL_COST = 0.15
VARIANTS = ("memory", "journal", "replica")
LABELS = {
    "memory": "journal off (durability: memory)",
    "journal": "journal + archiver",
    "replica": "journal + archiver, ack: replica",
}


def _per(cpu_s: float, writes: float) -> float | None:
    return round(cpu_s / writes * 1e6, 1) if writes else None


def variant(phase: dict[str, Any], kind: str) -> dict[str, Any]:
    """One phase's figures: writes/s, and CPU µs per write by process kind. The archiver's and
    PostgreSQL's count the wait for the archive to catch up too: that work belongs to these writes."""
    if "skipped" in phase:
        return {"skipped": phase["skipped"]}
    writes = phase["items"] if kind == "raw" else phase["scores_written"]
    rate = phase["items_per_s"] if kind == "raw" else phase["writes_per_s"]
    cpu = phase["cpu"]
    used = dict(cpu["cpu_s"])
    j = phase.get("journal", {})
    drain = j.get("drain_cpu", {}).get("cpu_s", {})
    for name in ("archiver", "postgres"):
        used[name] = used.get(name, 0.0) + drain.get(name, 0.0)
    out: dict[str, Any] = {
        "writes_per_s": rate,
        "writes": writes,
        "failures": phase.get("errors", phase.get("failures", 0)),
        "redis_master_us": _per(used.get("redis masters", 0.0), writes),
        "redis_replica_us": _per(used.get("redis replicas", 0.0), writes),
        "archiver_us": _per(used["archiver"], writes),
        "postgres_us": _per(used["postgres"], writes),
        "machine_us": _per(cpu["machine_cpu_s"], writes),
        "other_cores": round(cpu["other_cpu_s"] / cpu["wall_s"], 2) if cpu.get("wall_s") else None,
    }
    if j:
        out.update(
            lag_entries_at_end=j["lag_entries_at_end"],
            lag_seconds_at_end=j["lag_seconds_at_end"],
            drain_s=j["drain_s"],
            drained=j["drained"],
            results_per_entry=j["results_per_entry"],
            entries_added=j["entries_added"],
            phase_seconds=cpu["wall_s"],
        )
    return out


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if not a or not b or "skipped" in a or "skipped" in b or not b.get("writes_per_s"):
        return None
    return round(float(a["writes_per_s"]) / float(b["writes_per_s"]), 3)


def figures(durability: dict[str, Any]) -> dict[str, Any]:
    """Per path (raw, http) and variant, the figures of ``variant``; and the ratios: journal over
    memory (its cost is 1 - that), replica over primary (both journaled)."""
    out: dict[str, Any] = {}
    for kind in ("raw", "http"):
        phases = durability.get(kind)
        if not phases:
            continue
        got: dict[str, Any] = {name: variant(phases[name], kind) for name in VARIANTS if name in phases}
        journal = _ratio(got.get("journal"), got.get("memory"))
        got["journal_over_memory"] = journal
        got["journal_cost"] = round(1 - journal, 3) if journal is not None else None
        got["replica_over_primary"] = _ratio(got.get("replica"), got.get("journal"))
        out[kind] = got
    http = out.get("http", {})
    if http.get("journal_cost") is not None:
        out["goal"] = {"journal_cost_under": GOAL_COST, "met": http["journal_cost"] < GOAL_COST}
    return out


def costs(summary: dict[str, Any]) -> dict[str, float]:
    """What ``shardlb plan`` sizes journals from: a journal entry's bytes and each result's (journal
    memory), and the script calls a shard took per second in the journaled HTTP phase."""
    out: dict[str, float] = {}
    memory = summary.get("journal_memory") or {}
    for key in ("bytes_per_journal_entry", "bytes_per_journaled_result"):
        if isinstance(memory.get(key), int | float):
            out[key] = float(memory[key])
    d = summary.get("durability") or {}
    http = d.get("http", {}).get("journal")
    if http and "journal" in http and http.get("writes_per_s") and http.get("scores_written"):
        writing_s = http["scores_written"] / http["writes_per_s"]
        shards = summary["settings"]["shards"]
        out["journal_calls_per_shard_s"] = round(http["journal"]["entries_added"] / writing_s / shards, 1)
    return out


def finish(summary: dict[str, Any]) -> None:
    """Add ``durability_figures`` when the run had durability phases."""
    d = summary.get("durability")
    if d and "skipped" not in d:
        summary["durability_figures"] = figures(d)


def _v(value: Any, fmt: str = "g") -> str:
    return "-" if value is None else format(value, fmt)


def _row(kind: str, name: str, f: dict[str, Any]) -> str:
    path = "HTTP" if kind == "http" else "raw (library)"
    if "skipped" in f:
        return f"| {path} | {LABELS[name]} | skipped: {f['skipped']} | | | | | | | | |"
    lag = f"{f['lag_entries_at_end']:,} / {f['lag_seconds_at_end']:g}" if "lag_entries_at_end" in f else "-"
    drained = "-" if "drain_s" not in f else f"{f['drain_s']:g}" + ("" if f["drained"] else " (not drained)")
    return (
        f"| {path} | {LABELS[name]} | {_v(f['writes_per_s'], ',.0f')} | {_v(f['redis_master_us'])} "
        f"| {_v(f['redis_replica_us'])} | {_v(f['archiver_us'])} | {_v(f['postgres_us'])} "
        f"| {_v(f['machine_us'])} | {lag} | {drained} | {_v(f.get('results_per_entry'))} |"
    )


def markdown(summary: dict[str, Any]) -> list[str]:
    """The durability section of summary.md (nothing when the run had none)."""
    d = summary.get("durability")
    if not d:
        return []
    lines = ["## Durability: journal and archiver on beside off, replica beside primary", ""]
    if "skipped" in d:
        return [*lines, f"Skipped: {d['skipped']}", ""]
    figs = summary.get("durability_figures") or figures(d)
    if d.get("archiver_died"):
        died = d["archiver_died"]
        lines += [f"**The archiver died during the run** ({died}): its figures are not a cost.", ""]
    lines += [
        f"Boards `{d['memory_board']}` (durability: memory) and `{d['journal_board']}` (journal), the "
        f"same players; archive in PostgreSQL ({d['postgres']}); HTTP phases at "
        f"{d['offered_writes']:,} writes/s offered through {d['router_workers']} router processes.",
        "",
        "| path | writes | writes/s | Redis masters µs/write | replicas µs/write | archiver µs/write "
        "| PostgreSQL µs/write | whole machine µs/write | archive lag at end (entries / s) "
        "| caught up in s | results per journal entry |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in ("http", "raw"):
        for name in VARIANTS:
            if name in figs.get(kind, {}):
                lines.append(_row(kind, name, figs[kind][name]))
    lines.append("")
    lines += _verdicts(figs)
    others = {
        f"{kind} {name}": f[name]["other_cores"]
        for kind, f in figs.items()
        if kind in ("raw", "http")
        for name in VARIANTS
        if name in f and f[name].get("other_cores") is not None
    }
    lines += [
        "CPU per write counts the wait for the archive to catch up after each journaled phase "
        "(the archiver's and PostgreSQL's share of those writes). Load from outside the bench (cores): "
        + ", ".join(f"{k} {v:g}" for k, v in others.items())
        + ".",
        "",
    ]
    return [*lines, *_journal_memory(summary.get("journal_memory"))]


def _verdicts(figs: dict[str, Any]) -> list[str]:
    lines = []
    for kind, path in (("http", "HTTP"), ("raw", "raw (library)")):
        f = figs.get(kind, {})
        if f.get("journal_cost") is None:
            continue
        mem, jr = f["memory"], f["journal"]
        line = (
            f"- {path}: journal + archiver / journal off = **{f['journal_over_memory']:g}** of the writes/s "
            f"(the journal costs {f['journal_cost']:.1%})"
        )
        if mem.get("redis_master_us") and jr.get("redis_master_us"):
            line += (
                f"; Redis masters {mem['redis_master_us']:g} -> {jr['redis_master_us']:g} µs/write, "
                f"archiver {_v(jr['archiver_us'])} + PostgreSQL {_v(jr['postgres_us'])} µs/write"
            )
        lines.append(line + ".")
    goal = figs.get("goal")
    if goal:
        lines.append(
            f"- goal: the journal costs under {goal['journal_cost_under']:.0%} of HTTP write throughput: "
            f"{'met' if goal['met'] else 'not met'} on this machine (every process shares its 2 cores: "
            "the archiver and PostgreSQL take CPU the router and Redis would otherwise use)."
        )
    http = figs.get("http", {})
    replica = http.get("replica")
    if replica and "skipped" in replica:
        lines.append(f"- replica acknowledgement: skipped ({replica['skipped']}).")
    elif http.get("replica_over_primary") is not None:
        lines.append(
            f"- replica / primary acknowledgement (both journaled): **{http['replica_over_primary']:g}** "
            "of the writes/s."
        )
    return [*lines, ""]


def _journal_memory(j: dict[str, Any] | None) -> list[str]:
    if not j:
        return []
    return [
        "## Journal memory",
        "",
        "| results per entry | entries | bytes per entry | bytes per result |",
        "|---:|---:|---:|---:|",
        *(
            f"| {r['results_per_entry']} | {r['entries']:,} | {r['bytes_per_entry']:g} "
            f"| {r['bytes_per_result']:g} |"
            for r in j["sizes"]
        ),
        "",
        "MEMORY USAGE of one shard's journal stream holding entries of fresh results "
        f"({j['member_bytes']}-byte `<match>\\0<player>` members), written by the write script. Fitted: "
        f"{j['bytes_per_journal_entry']:g} bytes per entry + {j['bytes_per_journaled_result']:g} per "
        "result; `shardlb plan` sizes the journals from these.",
        "",
    ]
