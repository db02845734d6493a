"""Prometheus metrics of the router, and the /metrics rendering.

With several workers, ``router.server`` points PROMETHEUS_MULTIPROC_DIR at a fresh directory before
any worker starts, and /metrics then sums every worker's values (prometheus-client multiprocess
mode), so a scrape sees the whole process group whichever worker answers it.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client import values as _values
from prometheus_client.metrics_core import Metric

from router.errors import redis_error_kind
from shardlb import archive
from shardlb.errors import ClusterUnavailable, PartlyApplied, ShardlbError


def _pid() -> int:
    return _process[0]


def _forked() -> None:
    _process[0] = os.getpid()


# In multiprocess mode every update of a value checks the process id, to notice a fork; on CPython
# that is a getpid() system call per update, several per request. The id is kept here instead and
# renewed in a forked child, which is all the check needs (prometheus-client's process_identifier).
_process = [os.getpid()]
os.register_at_fork(after_in_child=_forked)
if _values.ValueClass is not _values.MutexValue:
    _values.ValueClass = _values.MultiProcessValue(process_identifier=_pid)  # type: ignore[no-untyped-call]


def observer(histogram: Histogram) -> Callable[[float], None]:
    """``histogram.observe`` (a child, or a histogram without labels), the same counts in fewer
    steps: its bucket is found by bisection, where prometheus-client's ``observe`` tries the bounds
    one by one in Python (up to 15 a request's latency) after a check that the metric is not a
    labelled parent. Every request's latency goes through it, and each score batch's size and call
    time (with ``counter``, 1.3-1.6% of the app's instructions for a one-match post, 2.0-2.4% for
    ``/healthz``: ``make bench-app INSTRUCTIONS=1``, bench/README.md). The values
    updated are the histogram's own (a value object per bucket and its sum: in multiprocess mode
    the files /metrics reads), so a scrape sees what ``observe`` would have written;
    tests/test_router_metrics.py renders both side by side. Those are prometheus-client's private
    names: a release of it without them gets its own ``observe`` (not an error at every request)."""
    try:
        add = histogram._sum.inc
        buckets = [value.inc for value in histogram._buckets]
        bounds = list(histogram._upper_bounds)  # ascending, +Inf last: every amount has its bucket
    except AttributeError:
        return histogram.observe

    def observe(amount: float) -> None:
        add(amount)
        buckets[bisect.bisect_left(bounds, amount)](1)

    return observe


def counter(child: Counter) -> Callable[[float], None]:
    """``child.inc`` for counts never negative (those of the hot paths), without prometheus-client's
    checks of the metric and of the amount's sign: the child's value's own ``inc`` (a private name,
    as in ``observer``: without it, the child's ``inc``)."""
    value = getattr(child, "_value", None)
    inc: Callable[[float], None] = child.inc if value is None else value.inc
    return inc


LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

REQUEST_SECONDS = Histogram(
    "shardlb_http_request_duration_seconds",
    "Time to answer an HTTP request, by route template.",
    ["method", "route"],
    buckets=LATENCY_BUCKETS,
)
RESPONSES = Counter(
    "shardlb_http_responses_total", "HTTP responses by route and status.", ["route", "status"]
)
SCORES = Counter(
    "shardlb_scores_applied_total", "Scores applied to the cluster, by result status.", ["status"]
)
BATCH_SIZE = Histogram(
    "shardlb_coalescer_batch_size",
    "Scores per shard script call made by the write coalescer.",
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000),
)
QUEUE_DEPTH = Gauge(
    "shardlb_coalescer_queue_depth",
    "Scores accepted by the coalescer and not yet applied.",
    multiprocess_mode="livesum",
)
REJECTED = Counter("shardlb_coalescer_rejected_total", "Write requests refused by back-pressure.", ["reason"])
REDIS_SECONDS = Histogram(
    "shardlb_redis_call_duration_seconds",
    "Time of the router's calls to the cluster, by operation.",
    ["op"],
    buckets=LATENCY_BUCKETS,
)
REDIS_ERRORS = Counter(
    "shardlb_redis_errors_total", "Failed cluster calls, by operation and error kind.", ["op", "kind"]
)
CACHE = Counter(
    "shardlb_cache_requests_total", "Read cache lookups, by cache and result.", ["cache", "result"]
)
# Every worker keeps a view of the journals (one reading a cluster shares: router/journals.py): the
# scrape shows the newest view of a live worker. "max" would keep a stopped worker's last value for
# good (only live* modes drop it, in worker_exit) and would show an older, higher reading while the
# lag goes down.
JOURNAL_ENTRIES = Gauge(
    "shardlb_journal_lag_entries",
    "Journal entries not yet archived in PostgreSQL, in the journal furthest behind (nearest a bound).",
    multiprocess_mode="livemostrecent",
)
JOURNAL_RESULTS = Gauge(
    "shardlb_journal_lag_results",
    "Results not yet archived in PostgreSQL, in the journal furthest behind (nearest a bound).",
    multiprocess_mode="livemostrecent",
)
JOURNAL_SECONDS = Gauge(
    "shardlb_journal_lag_seconds",
    "Age of the oldest entry not yet archived in PostgreSQL, in the journal furthest behind (nearest a "
    "bound); the archivers' shardlb_archive_lag_seconds is the oldest over every journal.",
    multiprocess_mode="livemostrecent",
)
# Every worker reads the registry's reshards on its own (router/reshards.py), as the journals.
RESHARDS_UNDER_WAY = Gauge(
    "shardlb_reshards_under_way",
    "Boards with a reshard recorded and not finished (moving, or abandoned).",
    multiprocess_mode="livemostrecent",
)
RESHARDS_ABANDONED = Gauge(
    "shardlb_reshards_abandoned",
    "Reshards no mover has held the lease of for a lease or more: the board stays in both layouts and "
    "its old shards' change sets grow with every write until a mover resumes it (a router that may "
    "take it does) or it is cancelled.",
    multiprocess_mode="livemostrecent",
)
GC_PAUSE = Histogram(
    "shardlb_gc_pause_seconds",
    "Time a worker stood still in a garbage collection, by generation (router/heap.py).",
    ["generation"],
    buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
# The ban list's refreshes that read something (router/moderation.py, BanCache): "changes", the fields
# its change log named; "whole", the whole list (the first, a move the log lacks, hourly).
BAN_LIST_READS = Counter(
    "shardlb_ban_list_reads_total",
    "Refreshes of the router's ban list that read it: the fields changed (changes) or all of it (whole).",
    ["kind"],
)
RATE_LIMITED = Counter("shardlb_rate_limited_total", "Reads refused by the per-client rate limit.")
RESULTS_REFUSED = Counter(
    "shardlb_results_refused_total",
    "Results refused before they were written (banned, points_limit, rate_limit), by status.",
    ["status"],
)
# Refused results past the router's queue of them (router/moderation.py, LOG_MAX) while PostgreSQL is
# slow or away: counted and logged with the minute's count, not in `refused_results`.
REFUSED_UNRECORDED = Counter(
    "shardlb_refused_results_unrecorded_total",
    "Refused results left out of PostgreSQL's refused_results: the router's queue of them was full.",
)
CONNECTIONS_REFUSED = Counter(
    "shardlb_http_connections_refused_total",
    "Connections closed at once because the worker, or their client, held as many as allowed already "
    "(SHARDLB_MAX_CONNECTIONS, SHARDLB_MAX_CLIENT_CONNECTIONS).",
)


class redis_call:
    """Time a cluster call and count its failure by kind. (A class, not an asynccontextmanager:
    every read and every score batch passes here, and a generator per call cost more.) A plain
    ``with`` times the same: "my rank" takes it so, two coroutines less a read."""

    __slots__ = ("op", "start")

    def __init__(self, op: str) -> None:
        self.op = op
        self.start = 0.0

    async def __aenter__(self) -> None:
        self.start = time.perf_counter()

    async def __aexit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: object) -> None:
        self.__exit__(kind, e, tb)

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: object) -> None:
        if isinstance(e, PartlyApplied):  # counted by the error that kept its results out
            e = e.error
        # A missing player or a full queue is an answer, not a failed call; a cluster that cannot
        # serve it (ClusterUnavailable, NotAcknowledged: 503 cluster_unavailable) is one.
        if isinstance(e, Exception) and (
            not isinstance(e, ShardlbError) or isinstance(e, ClusterUnavailable)
        ):
            REDIS_ERRORS.labels(self.op, redis_error_kind(e)).inc()
        _seconds(self.op)(time.perf_counter() - self.start)


@functools.lru_cache(maxsize=256)
def _seconds(op: str) -> Callable[[float], None]:
    """The labelled child's observe (looking labels up costs more than observing)."""
    return observer(REDIS_SECONDS.labels(op))


def registry() -> CollectorRegistry:
    """What a scrape sees: every worker's values in multiprocess mode, else this process's."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        _drop_dead_workers(path)
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)  # type: ignore[no-untyped-call]
        return merged
    return REGISTRY


def _drop_dead_workers(path: str) -> None:
    """Drop the live gauges of worker processes that no longer exist. A worker killed outright
    (SIGKILL, the OOM killer) never reaches worker_exit, and its last queue depth would stay in the
    sum, and its last journal lag in the scrape, until the router restarts. One file per worker and
    mode (``gauge_live<mode>_<pid>.db``), a signal-0 probe each: a few per scrape."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    dead: set[int] = set()
    for name in names:
        if not (name.startswith("gauge_live") and name.endswith(".db")):
            continue
        digits = name[:-3].rpartition("_")[2]
        if digits.isdigit() and not _alive(int(digits)):
            dead.add(int(digits))
    for pid in dead:
        with contextlib.suppress(OSError):  # another scrape removed them first
            multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process under that id: not ours to judge
        return True
    return True


# The archiver's families (shardlb/archive.py), registered in every process that imports it, this
# one too: a router never moves them, and a scrape of it that showed them would say "archive lag 0"
# whatever the archivers' lag (they serve their own on --metrics-port).
_ARCHIVER_FAMILIES = frozenset(family.name for metric in archive.METRICS for family in metric.describe())


class _RouterFamilies:
    """A registry's families but the archiver's."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        return (family for family in self.source.collect() if family.name not in _ARCHIVER_FAMILIES)


def render() -> tuple[bytes, str]:
    """The metrics text and its content type."""
    scraped = CollectorRegistry(auto_describe=False)
    scraped.register(_RouterFamilies(registry()))
    return generate_latest(scraped), CONTENT_TYPE_LATEST


def worker_exit(pid: int) -> None:
    """Drop a finished worker's live gauges in multiprocess mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
