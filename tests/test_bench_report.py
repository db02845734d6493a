"""bench/report.py on the committed results: derived figures recomputed from the raw ones, and the
summary text saying what they are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import report

LATEST = Path(__file__).resolve().parent.parent / "bench" / "results" / "latest" / "summary.json"
DERIVED = ("ratios", "costs", "cpu_per_write", "contaminated", "durability_figures", "read_goals")


@pytest.fixture
def summary() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(LATEST.read_text())
    for key in DERIVED:
        data.pop(key, None)
    report.finish(data)
    return data


def test_ratios_and_goals_come_from_the_measured_rates(summary: dict[str, Any]) -> None:
    http = summary["http"]["writes"]["sustained_writes_per_s"]
    raw = summary["raw"]["writes"]["items_per_s"]
    assert summary["ratios"]["router_over_raw_writes"] == round(http / raw, 2)
    assert summary["goal"]["writes_met"] is (http >= summary["goal"]["writes_per_s"])


def test_cpu_per_write_adds_up_to_the_phase_cpu(summary: dict[str, Any]) -> None:
    w = summary["http"]["writes"]
    cpu = w["cpu"]["cpu_s"]
    per = summary["cpu_per_write"]["http"]
    n = w["scores_written"]
    store = cpu["redis masters"] + cpu["redis replicas"]
    assert per["router"] == pytest.approx(cpu["router"] / n * 1e6, abs=0.1)
    assert per["locust"] == pytest.approx(cpu["locust"] / n * 1e6, abs=0.1)
    assert per["store"] == pytest.approx(store / n * 1e6, abs=0.1)
    raw = summary["raw"]["writes"]
    assert summary["cpu_per_write"]["raw"]["library"] == pytest.approx(
        raw["driver_cpu_seconds"] / raw["items"] * 1e6, abs=0.1
    )


def test_markdown_states_ratio_goals_and_cpu_split(summary: dict[str, Any]) -> None:
    text = report.markdown(summary, "test")
    ratio = summary["ratios"]["router_over_raw_writes"]
    assert f"router / raw limit, writes: **{ratio}**" in text
    assert "CPU per player-score write, whole machine (phase averages): HTTP = router" in text
    per = summary["cpu_per_write"]
    bound = (per["raw"]["library"] + per["raw"]["store"]) / (per["http"]["locust"] + per["http"]["store"])
    assert report.zero_cost_router_bound(per) == round(bound, 2)
    assert f"would be about {round(bound, 2):.2f} even for a router that cost nothing" in text
    met = "met" if summary["goal"]["writes_met"] else "not met"
    assert f"player-score writes/s through HTTP: {met} on this machine" in text
    for endpoint in summary["http"]["writes"]["endpoints"]:
        if endpoint != "Aggregated":
            assert endpoint.split(" ", 1)[1] in text
