"""bench/server_latency.py: the router's own write latency from its Prometheus histogram."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from bench import server_latency
from router.metrics import LATENCY_BUCKETS


def _page(durations: list[float], other: tuple[float, ...] = ()) -> str:
    """A /metrics page as the router writes it, with these score-write durations (seconds) and
    ``other`` durations of another route."""
    registry = CollectorRegistry()
    h = Histogram(
        "shardlb_http_request_duration_seconds",
        "Time to answer an HTTP request, by route template.",
        ["method", "route"],
        buckets=LATENCY_BUCKETS,
        registry=registry,
    )
    for d in durations:
        h.labels("POST", server_latency.ROUTE).observe(d)
    for d in other:
        h.labels("GET", "/v1/boards/{board}/top").observe(d)
    return generate_latest(registry).decode()


def test_buckets_of_the_score_route_only() -> None:
    buckets = server_latency.parse(_page([0.003, 0.02, 0.02], other=(0.3,) * 50))
    assert buckets[math.inf] == 3
    assert buckets[0.005] == 1 and buckets[0.025] == 3 and buckets[0.001] == 0


def test_quantiles_of_the_requests_between_two_scrapes() -> None:
    """Only the requests between the scrapes count; a percentile is interpolated inside its bucket
    (Prometheus' histogram_quantile), and past the last finite bound it is that bound."""
    before = server_latency.parse(_page([9.0] * 100))  # long ones before the window: left out
    during = [0.002] * 50 + [0.007] * 40 + [0.04] * 9 + [20.0]
    after = server_latency.parse(_page([9.0] * 100 + during))
    got = server_latency.quantiles(before, after, (0.5, 0.95, 0.99, 0.999))
    assert got["p50_ms"] == pytest.approx(2.5, abs=0.05)  # the 50th of 50 in (1, 2.5] ms: its top
    assert 25.0 < (got["p95_ms"] or 0) <= 50.0  # in the (25, 50] ms bucket
    assert got["p99_ms"] == pytest.approx(50.0, abs=0.05)
    assert got["p99.9_ms"] == 10_000.0  # beyond 10 s, the last finite bound
    assert server_latency.quantiles(after, after, (0.5,)) == {"p50_ms": None}
    assert server_latency.quantiles({}, {}, (0.99,)) == {"p99_ms": None}


def test_an_unreachable_router_gives_no_buckets() -> None:
    assert server_latency.scrape("http://127.0.0.1:9", timeout=0.5) == {}


def _gc_page(pauses: list[tuple[int, float]]) -> str:
    """A /metrics page with the router's garbage-collection pauses (router/metrics.py GC_PAUSE)."""
    registry = CollectorRegistry()
    h = Histogram(
        "shardlb_gc_pause_seconds",
        "Time a worker stood still in a garbage collection.",
        ["generation"],
        buckets=(0.001, 0.01, 0.1),
        registry=registry,
    )
    for generation, seconds in pauses:
        h.labels(str(generation)).observe(seconds)
    return generate_latest(registry).decode()


def test_the_collections_between_two_scrapes_summed_over_generations() -> None:
    before = server_latency.parse_gc(_gc_page([(0, 0.004)]) + _page([0.002]))
    after = server_latency.parse_gc(_gc_page([(0, 0.004), (0, 0.008), (1, 0.0125), (2, 0.03)]))
    assert before == {"collections": 1, "pause_s": pytest.approx(0.004)}
    assert server_latency.gc_between(before, after) == {"collections": 3, "pause_ms": 50.5}
    assert server_latency.gc_between(None, after) is None
    assert server_latency.parse_gc(_page([0.002])) == {"collections": 0, "pause_s": 0}
    assert server_latency.scrape_gc("http://127.0.0.1:9", timeout=0.5) is None


def test_a_window_needs_both_of_its_scrapes() -> None:
    """A scrape that failed reads as no buckets: the router's whole life would then pass for the
    window at the end of a step (its half-rate start and its spawning included). No figures
    instead; and none before the second scrape."""
    before = server_latency.parse(_page([0.003] * 10))
    after = server_latency.parse(_page([0.003] * 10 + [0.02] * 10))
    got = server_latency.window([before, after])
    assert got == server_latency.quantiles(before, after, (0.5, 0.95, 0.99)) and got["p50_ms"] is not None
    assert got["p50_ms"] > 5  # the later requests alone
    assert server_latency.window([{}, after]) is None
    assert server_latency.window([before, {}]) is None
    assert server_latency.window([before]) is None
