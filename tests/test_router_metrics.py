"""router/metrics.py in multiprocess mode: each process writes its own values, also after a fork,
and /metrics sums them; the process id that check uses is kept, not asked of the kernel per update.
Which failed cluster calls the errors counter counts, and under which kind."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from redis import exceptions as rx

from router import metrics
from shardlb.errors import NotAcknowledged, Overloaded, PartlyApplied, PlayerNotFound

SCRIPT = """
import os, sys
from prometheus_client import values
from router import metrics

assert values.ValueClass is not values.MutexValue
route = "/v1/boards/{board}/top"
metrics.RESPONSES.labels(route, "200").inc()
child = os.fork()
if child == 0:
    metrics.RESPONSES.labels(route, "200").inc(2)
    os._exit(0)
os.waitpid(child, 0)
metrics.RESPONSES.labels(route, "200").inc(4)
body, _ = metrics.render()
line = [x for x in body.decode().splitlines() if x.startswith("shardlb_http_responses_total{")][0]
print(line.rsplit(" ", 1)[1], len(os.listdir(sys.argv[1])))
"""


def test_a_forked_process_counts_apart_and_the_scrape_sums_every_process(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    total, files = done.stdout.split()
    assert float(total) == 7.0
    assert int(files) >= 2  # one counter file per process


GAUGES = """
import json, os
from prometheus_client import CollectorRegistry, generate_latest, multiprocess


def worker(value):
    child = os.fork()
    if child == 0:
        from router import metrics  # here, not in the scraping process: it would hold values too

        lag = (metrics.JOURNAL_ENTRIES, metrics.JOURNAL_RESULTS, metrics.JOURNAL_SECONDS)
        for gauge in (*lag, metrics.QUEUE_DEPTH):
            gauge.set(value)
        if value == 500:  # this worker ends: the lifespan's last step
            metrics.worker_exit(os.getpid())
        os._exit(0)
    os.waitpid(child, 0)


def scrape():
    merged = CollectorRegistry()
    multiprocess.MultiProcessCollector(merged)
    body = generate_latest(merged)
    names = ("shardlb_journal_lag_", "shardlb_coalescer_queue_depth")
    return {
        line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line.startswith(names)
    }


worker(500)  # a worker that saw a long lag, then stopped
after_exit = scrape()
worker(9)  # two live workers' readings since, the later one lower: the lag is going down
worker(7)
print(json.dumps([after_exit, scrape()]))
"""


def test_a_stopped_workers_gauges_leave_the_scrape(tmp_path: Path) -> None:
    """Journal lag is one cluster-wide quantity that every worker reads: the scrape shows the newest
    reading of a live worker (not the largest, which may be one from five seconds ago), never the
    last one of a worker that has stopped."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", GAUGES], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    after_exit, with_live = json.loads(done.stdout)
    assert after_exit == {}
    assert with_live == {
        "shardlb_journal_lag_entries": 7.0,
        "shardlb_journal_lag_results": 7.0,
        "shardlb_journal_lag_seconds": 7.0,
        "shardlb_coalescer_queue_depth": 16.0,  # each worker's own queue: the live ones' sum
    }


KILLED = """
import json, os, signal, sys
from router import metrics

child = os.fork()
if child == 0:  # a worker that the OOM killer (or SIGKILL) stops: its lifespan never ends
    metrics.QUEUE_DEPTH.set(40)
    metrics.JOURNAL_SECONDS.set(900)
    os.kill(os.getpid(), signal.SIGKILL)
os.waitpid(child, 0)
metrics.QUEUE_DEPTH.set(3)  # this process: a live worker
body, _ = metrics.render()
names = ("shardlb_journal_lag_seconds", "shardlb_coalescer_queue_depth")
print(json.dumps({
    line.split(" ")[0]: float(line.rsplit(" ", 1)[1])
    for line in body.decode().splitlines()
    if line.startswith(names)
}))
print(json.dumps(sorted(n for n in os.listdir(sys.argv[1]) if n.startswith("gauge_live"))))
"""


def test_a_killed_workers_live_gauges_leave_the_scrape(tmp_path: Path) -> None:
    """A worker killed outright (SIGKILL, the OOM killer) never runs worker_exit: the scrape drops
    the live gauges of a process that no longer exists, so the queue depth is the live workers'
    sum and the journal lag a live worker's reading, not the dead one's last values for good."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", KILLED, str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    values, files = (json.loads(line) for line in done.stdout.splitlines())
    assert values.get("shardlb_coalescer_queue_depth") == 3.0
    assert values.get("shardlb_journal_lag_seconds", 0.0) != 900.0
    assert len({name.rsplit("_", 1)[1] for name in files}) == 1  # only the live process's files


FAMILIES = """
import json
import router.app  # noqa: F401 -- all a worker imports, shardlb.archive among it (moderation, settlement)
from router import metrics

body, _ = metrics.render()
types = [line for line in body.decode().splitlines() if line.startswith("# TYPE ")]
print(json.dumps(sorted(line.split(" ")[2] for line in types)))
"""


def test_the_scrape_holds_no_archiver_metric_in_either_mode(tmp_path: Path) -> None:
    """A router imports shardlb/archive.py, whose counters and gauges register where it is imported.
    A router never moves them: its /metrics showed `shardlb_archive_lag_seconds 0.0` (and the
    archiver's other families at 0) beside its own journal lag, which read as an archive caught up
    to whoever scraped a router; the archivers' port serves them (k8s/README.md, "The archive")."""
    for env in (dict(os.environ), {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}):
        done = subprocess.run(
            [sys.executable, "-c", FAMILIES], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        families = json.loads(done.stdout)
        assert "shardlb_journal_lag_seconds" in families  # the router's own
        assert [f for f in families if f.startswith("shardlb_archive_") or f == "shardlb_band_repairs"] == []


OBSERVED = """
import json
from prometheus_client import Counter, Histogram
from router import metrics

# The same amounts through prometheus-client's own observe and inc, and through the router's.
amounts = [0.0, -1.0, 0.0004, 0.0005, 0.00050001, 0.001, 0.003, 0.1, 9.99, 10.0, 10.5, 1e9, float("inf")]
plain = Histogram("shardlb_test_plain_seconds", "", ["route"], buckets=metrics.LATENCY_BUCKETS)
fast = Histogram("shardlb_test_fast_seconds", "", ["route"], buckets=metrics.LATENCY_BUCKETS)
sizes_plain = Histogram("shardlb_test_plain_size", "", buckets=(1, 2, 5, 10))
sizes_fast = Histogram("shardlb_test_fast_size", "", buckets=(1, 2, 5, 10))
counted_plain = Counter("shardlb_test_plain", "", ["status"])
counted_fast = Counter("shardlb_test_fast", "", ["status"])
observe, size = metrics.observer(fast.labels("r")), metrics.observer(sizes_fast)
count = metrics.counter(counted_fast.labels("ok"))
for amount in amounts:
    plain.labels("r").observe(amount)
    observe(amount)
for n in (0, 1, 2, 3, 10, 11, 100):
    sizes_plain.observe(n)
    size(n)
    counted_plain.labels("ok").inc(n)
    count(n)
samples = {}
for family in metrics.registry().collect():
    for sample in family.samples:
        if sample.name.startswith("shardlb_test_") and not sample.name.endswith("_created"):
            samples[f"{sample.name}{sorted(sample.labels.items())}"] = sample.value
print(json.dumps(samples))
"""


def test_the_routers_observe_and_inc_count_as_prometheus_clients_own(tmp_path: Path) -> None:
    """``metrics.observer`` and ``metrics.counter`` (the hot paths' shorter ways to observe and
    count) write what prometheus-client's ``observe`` and ``inc`` write, at every bucket's bound and
    beside it, in one process and in multiprocess mode (where the values are files)."""
    for env in (dict(os.environ), {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}):
        done = subprocess.run(
            [sys.executable, "-c", OBSERVED], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        samples = json.loads(done.stdout)
        plain = {k.replace("_plain", ""): v for k, v in samples.items() if "_plain" in k}
        fast = {k.replace("_fast", ""): v for k, v in samples.items() if "_fast" in k}
        assert len(plain) >= len(metrics.LATENCY_BUCKETS) + 1 + 5 + 1  # every bucket of both, a count
        assert fast == plain


def test_a_prometheus_client_without_the_private_names_observes_and_counts_through_its_own() -> None:
    """``observer`` and ``counter`` read prometheus-client's private names (``_sum``, ``_buckets``,
    ``_upper_bounds``, ``_value``), which its releases may rename (pyproject.toml sets no upper
    bound): a metric without them is observed and counted through its own ``observe`` and ``inc``,
    where an AttributeError stopped the router's import (the coalescer's batch size) and would
    have failed every request's latency."""

    class Bare:  # a metric of such a release: its public methods alone
        def __init__(self) -> None:
            self.seen: list[float] = []

        def observe(self, amount: float) -> None:
            self.seen.append(amount)

        def inc(self, amount: float = 1) -> None:
            self.seen.append(-amount)

    bare = Bare()
    metrics.observer(bare)(0.3)  # type: ignore[arg-type]
    metrics.counter(bare)(2)  # type: ignore[arg-type]
    assert bare.seen == [0.3, -2]


def _redis_errors(op: str, kind: str) -> float:
    return metrics.registry().get_sample_value("shardlb_redis_errors_total", {"op": op, "kind": kind}) or 0.0


async def _failing_call(op: str, error: BaseException) -> None:
    with contextlib.suppress(type(error)):
        async with metrics.redis_call(op):
            raise error


async def test_a_write_no_replica_confirmed_counts_as_a_failed_cluster_call() -> None:
    # NotAcknowledged is a ClusterUnavailable (503 cluster_unavailable): cluster trouble, not an
    # answer like a missing player, so the errors counter has to show it.
    before = _redis_errors("test_unacked", "NotAcknowledged")
    await _failing_call("test_unacked", NotAcknowledged("0 of 1 replicas confirmed the write"))
    assert _redis_errors("test_unacked", "NotAcknowledged") == before + 1


async def test_a_partly_applied_batch_counts_the_error_that_stopped_it() -> None:
    before = _redis_errors("test_partly", "ConnectionError")
    await _failing_call("test_partly", PartlyApplied([None], rx.ConnectionError("connection reset")))
    assert _redis_errors("test_partly", "ConnectionError") == before + 1
    assert _redis_errors("test_partly", "other") == 0


async def test_an_answer_of_the_library_is_no_failed_cluster_call() -> None:
    await _failing_call("test_answers", PlayerNotFound("no such player", "player"))
    await _failing_call("test_answers", Overloaded("too many calls waiting"))
    for kind in ("PlayerNotFound", "Overloaded", "other"):
        assert _redis_errors("test_answers", kind) == 0
