"""The router's own latency for score writes, from its Prometheus histogram, beside Locust's.

Locust times a request from its own side of the socket, so on a machine whose cores the load
generator shares with the router and Redis its figures include its own waits for a core. The router
times every request from the moment the ASGI app has it until its response is handed to the server
(``shardlb_http_request_duration_seconds``, router/metrics.py): what the service itself took,
without the client's scheduling (but with the router's own waits for a core, and without the time
a request spent in the socket before the router read it).

``scrape`` reads the cumulative bucket counts of the score route from ``/metrics`` (the workers'
figures summed by prometheus-client's multiprocess mode); ``quantiles`` turns the difference of two
scrapes into percentiles, interpolated linearly inside the bucket where each falls, as Prometheus'
``histogram_quantile`` does. A percentile beyond the last finite bound is reported as that bound.
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

METRIC = "shardlb_http_request_duration_seconds"
ROUTE = "/v1/boards/{board}/scores"

Buckets = dict[float, float]  # upper bound in seconds (math.inf for +Inf) -> requests at most that long


def parse(text: str, route: str = ROUTE, method: str = "POST") -> Buckets:
    """The cumulative bucket counts of ``method`` ``route`` in a /metrics page."""
    buckets: Buckets = {}
    for family in text_string_to_metric_families(text):
        if family.name != METRIC:
            continue
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name.endswith("_bucket")
                and labels.get("route") == route
                and labels.get("method") == method
            ):
                bound = float(labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return buckets


def scrape(url: str, timeout: float = 5.0) -> Buckets:
    """The score route's buckets from a router's /metrics (empty when it cannot be read)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as r:
            return parse(r.read().decode())
    except OSError:
        return {}


def quantiles(
    before: Mapping[float, float], after: Mapping[float, float], qs: Sequence[float]
) -> dict[str, float | None]:
    """``{"p50_ms": ..., ...}`` of the requests counted between two scrapes (None without any)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    out: dict[str, float | None] = {}
    for q in qs:
        name = f"p{q * 100:g}_ms"
        if total <= 0:
            out[name] = None
            continue
        rank = q * total
        lower, below = 0.0, 0.0
        for bound, count in zip(bounds, counts, strict=True):
            if count >= rank:
                if math.isinf(bound):
                    value = lower  # past the last finite bound: that bound
                else:
                    inside = count - below
                    value = lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
                out[name] = round(value * 1000, 1)
                break
            lower, below = bound, count
    return out


def window(
    scrapes: Sequence[Buckets], qs: Sequence[float] = (0.5, 0.95, 0.99)
) -> dict[str, float | None] | None:
    """``quantiles`` between a window's two scrapes, or None unless both were read: a failed scrape
    reads as no buckets, and the router's whole life would pass for the window."""
    if len(scrapes) != 2 or not scrapes[0] or not scrapes[1]:
        return None
    return quantiles(scrapes[0], scrapes[1], qs)


GC_METRIC = "shardlb_gc_pause_seconds"


def parse_gc(text: str) -> dict[str, float]:
    """The router's garbage collections so far in a /metrics page: ``collections`` and their
    ``pause_s`` summed over generations (router/heap.py's histogram)."""
    out = {"collections": 0.0, "pause_s": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name != GC_METRIC:
            continue
        for sample in family.samples:
            if sample.name.endswith("_count"):
                out["collections"] += sample.value
            elif sample.name.endswith("_sum"):
                out["pause_s"] += sample.value
    return out


def scrape_gc(url: str, timeout: float = 5.0) -> dict[str, float] | None:
    """``parse_gc`` of a router's /metrics, or None when it cannot be read."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as r:
            return parse_gc(r.read().decode())
    except OSError:
        return None


def gc_between(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """The collections made between two ``scrape_gc`` readings and their pauses in ms (None
    without both)."""
    if before is None or after is None:
        return None
    return {
        "collections": round(after["collections"] - before["collections"]),
        "pause_ms": round((after["pause_s"] - before["pause_s"]) * 1000, 1),
    }
