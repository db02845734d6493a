"""bench/durability_report.py on the committed results: the journal's cost recomputed from the
measured rates and CPU, the plan's journal costs from the same phases, and what summary.md says."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import durability_report, journal, report
from bench.durability import router_knows

LATEST = Path(__file__).resolve().parent.parent / "bench" / "results" / "latest" / "summary.json"


@pytest.fixture
def summary() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(LATEST.read_text())
    data.pop("durability_figures", None)
    durability_report.finish(data)
    return data


def test_journal_cost_comes_from_the_measured_rates(summary: dict[str, Any]) -> None:
    d, figs = summary["durability"], summary["durability_figures"]
    for kind, rate in (("raw", "items_per_s"), ("http", "writes_per_s")):
        ratio = d[kind]["journal"][rate] / d[kind]["memory"][rate]
        assert figs[kind]["journal_over_memory"] == round(ratio, 3)
        assert figs[kind]["journal_cost"] == round(1 - round(ratio, 3), 3)
    assert figs["goal"]["met"] is (figs["http"]["journal_cost"] < durability_report.GOAL_COST)


def test_cpu_per_write_counts_the_archive_catching_up(summary: dict[str, Any]) -> None:
    phase = summary["durability"]["raw"]["journal"]
    f = summary["durability_figures"]["raw"]["journal"]
    phase_cpu, drain_cpu = phase["cpu"]["cpu_s"], phase["journal"]["drain_cpu"]["cpu_s"]
    n = phase["items"]
    for name, key in (("archiver", "archiver_us"), ("postgres", "postgres_us")):
        assert f[key] == pytest.approx((phase_cpu[name] + drain_cpu[name]) / n * 1e6, abs=0.1)
    assert f["redis_master_us"] == pytest.approx(phase_cpu["redis masters"] / n * 1e6, abs=0.1)
    assert f["lag_entries_at_end"] == phase["journal"]["lag_entries_at_end"]
    # The memory board's phase ran without an archiver: nothing of it is counted there.
    assert summary["durability_figures"]["raw"]["memory"]["archiver_us"] == 0


def test_plan_costs_come_from_the_journal_phases(summary: dict[str, Any]) -> None:
    costs = report.costs(summary)
    memory = summary["journal_memory"]
    assert costs["bytes_per_journal_entry"] == memory["bytes_per_journal_entry"]
    assert costs["bytes_per_journaled_result"] == memory["bytes_per_journaled_result"]
    http = summary["durability"]["http"]["journal"]
    seconds = http["scores_written"] / http["writes_per_s"]
    calls = http["journal"]["entries_added"] / seconds / summary["settings"]["shards"]
    assert costs["journal_calls_per_shard_s"] == pytest.approx(calls, abs=0.05)


def test_markdown_states_the_cost_the_goal_and_the_replica_phase(summary: dict[str, Any]) -> None:
    text = report.markdown(summary, "test")
    figs = summary["durability_figures"]
    ratio = figs["http"]["journal_over_memory"]
    assert f"- HTTP: journal + archiver / journal off = **{ratio:g}** of the writes/s" in text
    met = "met" if figs["goal"]["met"] else "not met"
    assert f"under 15% of HTTP write throughput: {met} on this machine" in text
    replica = figs["http"]["replica"]
    if "skipped" in replica:
        assert f"- replica acknowledgement: skipped ({replica['skipped']})." in text
    else:
        ratio = figs["http"]["replica_over_primary"]
        assert f"replica / primary acknowledgement (both journaled): **{ratio:g}**" in text
    for row in summary["journal_memory"]["sizes"]:
        assert f"| {row['results_per_entry']} | {row['entries']:,} | {row['bytes_per_entry']:g} |" in text


def test_a_skipped_replica_phase_is_a_row_not_a_ratio(summary: dict[str, Any]) -> None:
    d = {**summary["durability"], "http": {**summary["durability"]["http"], "replica": {"skipped": "why"}}}
    figs = durability_report.figures(d)
    assert figs["http"]["replica"] == {"skipped": "why"}
    assert figs["http"]["replica_over_primary"] is None
    text = "\n".join(durability_report.markdown({**summary, "durability": d, "durability_figures": figs}))
    assert "| HTTP | journal + archiver, ack: replica | skipped: why |" in text


def test_router_knows_only_its_own_settings() -> None:
    # The replica phase runs only when the router reads SHARDLB_ACK; it ignores unknown variables.
    assert router_knows("read_rate") and router_knows("coalesce_max_batch")
    assert not router_knows("no_such_setting")


def test_journal_bytes_fit_a_line() -> None:
    assert journal.fit([(1, 300.0), (10, 1020.0), (60, 5020.0)]) == pytest.approx((220.0, 80.0))
