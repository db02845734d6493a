"""`shardlb plan`: size a deployment from the per-operation costs the last bench measured.

    shardlb plan --players 50000000 --writes 20000 --reads 5000 [--replicas 1] [--periods total,daily]
                 [--incr 0.5] [--timeless 0.2] [--dedup-window 86400] [--journaled 1]
                 [--journal-max-results 1000000] [--journal-max-entries 1000000]
                 [--masters-now 3] [--shards-now 16] [--scores-per-request 100] [--write-routers 3]
                 [--board global]

The costs (CPU microseconds per write and per read on a Redis master and in the router, bytes per
player) come from bench/results/latest/summary.json, written by `make bench`, and the bytes per incr
dedup record, the bytes per pin and the CPU of a dedup lookup from bench/results/latest/dedup.json,
written by `make bench-dedup`, and a write script call's fixed part and each score's part of a
master's CPU from bench/results/latest/load-steps.json, written by `make bench-load-steps`; the
PostgreSQL bytes per archived result are DEFAULTS' figure from `make bench-archive`; without
them, the DEFAULTS below (from runs on the 2-core development
machine) are used and the output says so. The model is deliberately simple and printed in full:
every number can be checked by hand. With today's layout (``--masters-now``, ``--shards-now``) it
also prints the steps from there to the plan's: masters added or removed (``shardlb cluster``, or on
Kubernetes the StatefulSet and ``redis-cli --cluster``) and the board's online reshard (``shardlb
reshard``). When bench/results/latest/scaleout.json is there (`make bench-scaleout`), what one to
three masters measured is printed beside the model's assumptions about them.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardlb.board import JOURNAL_MAX_ENTRIES, JOURNAL_MAX_RESULTS
from shardlb.config import DEDUP_BUCKETS, DEFAULT_DEDUP_WINDOW_S, PIN_SPAN
from shardlb.keys import SLOTS

LATEST = Path(__file__).resolve().parent / "results" / "latest" / "summary.json"
DEDUP_SUMMARY = "dedup.json"  # beside summary.json
SCALEOUT_SUMMARY = "scaleout.json"  # beside summary.json
K8S_STEP = 'k8s/README.md, "7. Scale Redis: add masters"'

# Measured by `make bench` on the 2-core development machine (bench/results/latest, 2026-11-30 10:06).
DEFAULTS: dict[str, float] = {
    "bytes_per_player": 112.6,
    "redis_master_us_per_write": 7.0,
    "redis_replica_us_per_write": 2.0,
    "router_us_per_write": 21.1,
    # What a request costs the router whatever its scores, and the scores a request of the ramp
    # carried (the size router_us_per_write is measured at): the light client's maximums of 10 and
    # 100 scores a request (`make bench` 2026-12-04 15:52: 25.5 and 9.3 µs a write).
    "router_us_per_request": 180.0,
    "router_scores_per_request": 10.0,
    "redis_master_us_per_read": 1490.3,
    "router_us_per_read": 1254.8,
    # `make bench-dedup` (bench/results/latest/dedup.json, 2026-12-01): one `<uuid>\0<17-digit id>`
    # member of a large dedup set, and one SISMEMBER of a new result in write.lua.
    "bytes_per_dedup_member": 108.7,
    # A pin (`<uuid>\0<17-digit id>` -> its first server time) of a result sent without achieved_at:
    # 1M of them in one hash, INFO used_memory before and after (2026-12-02).
    "bytes_per_pin": 120.4,
    "redis_master_us_per_dedup_lookup": 0.3,
    # `make bench` (journal memory, 2026-12-01 07:03): a journal entry's own bytes and each result's.
    "bytes_per_journal_entry": 216.6,
    "bytes_per_journaled_result": 67.0,
    # A row of the archive's match_results, its indexes included: `make bench-archive`
    # (bench/archive_size.py, 1,000,000 results through the archiver's own upsert, UUID match ids,
    # PostgreSQL 15, 2026-12-05). Nothing removes a row while its board lives (shardlb/prune.py).
    "bytes_per_archived_result": 356.6,
    # A read's Redis cost on each node it touches: a fixed part per node (its round trip: the system
    # calls and the pipeline) and a part per shard the node holds. Split from the hot reads' "my rank"
    # on 3 and on 16 shards (bench/hot.py, 2026-12-01 21:37) and scaled to the mix's cost on 16 shards.
    "redis_node_us_per_read": 155.0,
    "redis_shard_us_per_read": 46.0,
    # A band board of one home shard and one band per master against the hash board of one shard per
    # master, same run (`make bench` 2026-12-02 20:03: the band board's read mix, its write step
    # beside the hash board's, and its memory after loading): ``--sharding band`` scales by them.
    "band_store_read_factor": 0.484,
    "band_router_read_factor": 0.913,
    "band_store_write_factor": 2.047,
    "band_router_write_factor": 1.131,
    "band_bytes_per_player": 387.0,
    # A write script call's fixed part and each of its scores' part of a master's CPU: the library's
    # batches of 1 and of 100 matches on a 3-shard board (`make bench-load-steps`, bench/load_steps.py,
    # 2026-12-04 18:10). redis_master_us_per_write was measured in calls of raw_scores_per_call
    # scores (the raw run's, from its INFO commandstats); a router's calls are smaller when its
    # share of a shard's writes is small, and each pays the fixed part.
    "redis_master_us_per_call": 106.1,
    "redis_master_us_per_score_in_call": 13.52,
    "raw_scores_per_call": 62.5,
}
SHARDINGS = ("hash", "band")
BENCH_SHARDS = 16  # the board the costs were measured on
# Where reads go (the routers' SHARDLB_READ_FROM): the nodes of each primary's group that serve them.
READERS = {"primary": lambda replicas: 1, "replicas": lambda replicas: replicas, "any": lambda r: 1 + r}
CACHED_SHARE = 0.30  # the bench mix's top-100 reads, which the routers' top cache answers from RAM

MASTER_UTILISATION = 0.5  # a Redis master runs commands on one core; keep half of it free
ROUTER_UTILISATION = 0.6  # a router process is one Python core; keep 40% for bursts and GC
MIN_ROUTER_US_PER_WRITE = 1.0  # a floor for router_write_us however large the requests
JOURNAL_HOLD_S = 300  # below this, the journal line says what bound would hold an outage this long
COALESCE_DELAY_S = 0.0015  # the routers' SHARDLB_COALESCE_DELAY_MS default: what a call waits to fill
LOAD_STEPS_SUMMARY = "load-steps.json"  # beside summary.json
CALL_COST_SHARDS = "3"  # the load-steps board whose two library steps give the call costs
MAX_DATA_PER_MASTER = 25 * 2**30  # beyond this, a full resync or a restart takes too long
MAX_PLAYERS_PER_SHARD = 50_000_000  # one sorted set stays one slot: keep it small enough to move
MAX_SHARDS = 1024  # a board's shard count at most (the API's limit)
MAX_MASTERS = MAX_SHARDS  # beyond one master a shard, more masters take no part of a board
# Redis Cluster promotes a replica only when a majority of the masters agree that its master failed:
# with 1 or 2 masters, losing one leaves no majority, so no failover (and `redis-cli --cluster
# create`, like k8s/base/redis/cluster-bootstrap.sh, refuses fewer than 3).
MIN_MASTERS = 3
MIN_MASTERS_WHY = f"the minimum: a failover needs a majority of masters, so {MIN_MASTERS} at least"
MAX_REPLICAS = 256  # replicas per master the planner will propose before it calls reads over budget
MAX_CLUSTER_NODES = 1000  # nodes of one Redis Cluster: its documented design target (cluster-spec)
# The largest load the planner takes (a trillion players, a trillion operations a second): far past any
# deployment, and small enough that its arithmetic stays finite (1e308 writes/s overflowed it).
MAX_PLAYERS = 10**12
MAX_RATE = 1e12
MAX_WRITE_ROUTERS = 10**6
# The routers' own limits on SHARDLB_JOURNAL_MAX_RESULTS and SHARDLB_JOURNAL_MAX_ENTRIES
# (router/settings.py): a bound they would refuse to start with is not one to plan for.
MAX_JOURNAL_RESULTS = 10**9
MAX_JOURNAL_ENTRIES = 10**8
FRAGMENTATION = 1.2  # jemalloc fragmentation and overhead over used_memory
FORK_HEADROOM = 2.0  # RAM per node over the data: a fork (replica sync, snapshot) may copy every page
# A journal entry is one write-script call: the router's batch for one shard, at most its
# SHARDLB_COALESCE_MAX_BATCH (500 by default) results.
MAX_RESULTS_PER_ENTRY = 500
EXTRA_PERIOD_WRITE_COST = 0.5  # each extra period adds one ZADD to a write's script: half a write

# Sorted sets alive at once per dated kind (the current one plus those kept by the default
# retention: daily 3 days, weekly 35 days, monthly 400 days) times the share of players active in one.
PERIOD_SETS = {"daily": (4, 0.10), "weekly": (6, 0.25), "monthly": (14, 0.40)}
# An incr result's dedup record lives one window plus at most one bucket (shardlb/config.py).
DEDUP_LIFETIME = 1 + 1 / DEDUP_BUCKETS
# A pin lives one window plus at most the PIN_SPAN buckets of its hash (shardlb/config.py).
PIN_LIFETIME = 1 + PIN_SPAN / DEDUP_BUCKETS


@dataclass(frozen=True)
class Plan:
    masters: int
    replicas: int
    shards: int
    read_from: str
    routers: int
    memory_per_node_bytes: int
    data_bytes: float
    dedup_bytes: float  # incr dedup records and pins
    redis_cores: float
    router_cores: float
    journal: Journal
    reasons: dict[str, str] = field(default_factory=dict)
    fits: bool = True  # False: past MAX_REPLICAS replicas a master, MAX_MASTERS or MAX_CLUSTER_NODES
    scores_per_call: float = 0.0  # in a router's write script call for one shard (``scores_per_call``)
    write_routers: int = 0  # the routers that take the writes (all of them unless a pool was asked)
    write_us: float = 0.0  # a master's CPU per write at that call size (w of the model)
    warnings: tuple[str, ...] = ()  # where a cap leaves the load short of what it needs

    @property
    def nodes(self) -> int:
        """Redis nodes: the masters and their replicas."""
        return self.masters * (1 + self.replicas)


def choose(plans: dict[str, Plan]) -> tuple[str, str]:
    """(the layout to recommend, why) among the plans of each layout for the same load: one that
    fits before one that does not, then the fewest Redis nodes, then the fewest router processes;
    on a tie the first given (hash: its writes cost less and it needs no band starts)."""
    best = min(plans, key=lambda k: (not plans[k].fits, plans[k].nodes, plans[k].routers))
    others = "; ".join(
        f"{name}: {_count(p.nodes, 'node')} and {_count(p.routers, 'router')}"
        f"{'' if p.fits else ', OVER BUDGET'}"
        for name, p in plans.items()
        if name != best
    )
    chosen = plans[best]
    return best, (
        f"{_count(chosen.nodes, 'Redis node')} and {_count(chosen.routers, 'router process')} against "
        f"{others} (--sharding hash|band plans one layout)"
    )


@dataclass(frozen=True)
class Journal:
    """The journals of one board at their bound (while PostgreSQL or the archiver is down)."""

    results_per_entry: float
    bytes_per_shard: float
    bytes_per_master: float
    buffer_s: float  # how long the bound holds the planned writes before writes are refused
    results: float = 0.0  # results a full journal holds (a shard)
    entries: float = 0.0  # entries that hold them
    bound: str = "results"  # the bound that is reached first: results, or entries


def journal_at_bound(
    writes: float,
    shards: int,
    per_master: int,
    costs: dict[str, float],
    max_entries: int,
    batch: float,
    max_results: int = JOURNAL_MAX_RESULTS,
) -> Journal:
    """A full journal per shard: write.lua refuses writes at ``max_results`` results not yet
    archived, or at ``max_entries`` entries, whichever comes first. An entry is one write script
    call, ``batch`` results (``scores_per_call``)."""
    by_entries = max_entries * batch
    held = min(float(max_results), by_entries)
    entries = held / batch
    per_shard = (
        entries * costs["bytes_per_journal_entry"] + held * costs["bytes_per_journaled_result"]
    ) * FRAGMENTATION
    buffer_s = held / (writes / shards) if writes else math.inf
    bound = "results" if max_results <= by_entries else "entries"
    return Journal(batch, per_shard, per_shard * per_master, buffer_s, held, entries, bound)


def memory_factor(periods: list[str]) -> float:
    """Player entries kept per player, relative to the total board alone."""
    return 1.0 + sum(live * active for kind, (live, active) in PERIOD_SETS.items() if kind in periods)


def dedup_members(writes: float, incr: float, window_s: int) -> float:
    """Incr dedup records alive at the peak: every incr result of one window plus one bucket."""
    return writes * incr * window_s * DEDUP_LIFETIME


def pins(writes: float, timeless: float, window_s: int) -> float:
    """Pins alive at the peak: every result sent without a time in one window plus a pin hash's span."""
    return writes * timeless * window_s * PIN_LIFETIME


def touched_shards(scores: float, shards: int) -> float:
    """The shards a request of ``scores`` scores writes to on average, each score's shard drawn
    uniformly (a player's home shard is a hash of their id)."""
    return shards * (1 - (1 - 1 / shards) ** scores)


def scores_per_call(writes: float, routers: int, shards: int, scores_per_request: float) -> float:
    """The scores in a router's write script call for one shard: a request's scores on that shard,
    plus the scores the router gets for it while the call waits out the coalescing delay (the first
    score of an idle group starts it: router/coalescer.py); 1 to MAX_RESULTS_PER_ENTRY. Calls that
    wait for another in flight grow beyond this under load, so it errs on the small side."""
    own = scores_per_request / touched_shards(scores_per_request, shards)
    gathered = writes / routers / shards * COALESCE_DELAY_S
    return min(float(MAX_RESULTS_PER_ENTRY), max(1.0, own + gathered))


def write_pool(writes: float, router_write_us: float) -> int:
    """The fewest routers whose CPU holds the writes alone (a pool that takes only the writes)."""
    return max(1, math.ceil(writes * router_write_us / 1e6 / ROUTER_UTILISATION))


def call_size_factor(c: dict[str, float], batch: float) -> float:
    """A master's CPU per write in calls of ``batch`` scores against that in the raw run's calls
    (where redis_master_us_per_write was measured): per score + per call / scores a call, at each."""
    per_call, per_score = c["redis_master_us_per_call"], c["redis_master_us_per_score_in_call"]
    measured = per_score + per_call / c["raw_scores_per_call"]
    return (per_score + per_call / batch) / measured if measured > 0 else 1.0


def plan(
    players: int,
    writes: float,
    reads: float,
    replicas: int,
    periods: list[str],
    costs: dict[str, float],
    incr: float = 0.0,
    dedup_window_s: int = DEFAULT_DEDUP_WINDOW_S,
    journaled: float = 1.0,
    journal_max_entries: int = JOURNAL_MAX_ENTRIES,
    cached: float = CACHED_SHARE,
    timeless: float = 0.0,
    sharding: str = "hash",
    scores_per_request: float | None = None,
    write_routers: int | None = None,
    journal_max_results: int = JOURNAL_MAX_RESULTS,
) -> Plan:
    """The sizing model (pure arithmetic; ``main`` prints it with its assumptions).

    ``scores_per_request``: the scores the game servers post in a request (None: as many as the
    bench's, ``router_scores_per_request``); the routers' CPU per write is then
    ``router_write_us`` (a request's fixed part spread over its scores).

    A master's CPU per write depends on how many scores the routers' script calls carry: each call
    has a fixed part (``redis_master_us_per_call``) beside its scores' part, and
    ``redis_master_us_per_write`` was measured in the raw run's calls of ``raw_scores_per_call``.
    A router's call for a shard holds a request's scores for it and what else the router gets for
    that shard within the coalescing delay (``scores_per_call``), so the more routers share the
    writes, and the more shards, the smaller the calls. ``write_routers``: the writes go to a pool
    of that many routers (at least as many as their CPU needs) and the reads to others; None: every
    router takes both.

    ``sharding`` ``band``: the board is a band board of one home shard and one band per master
    (docs/design-notes.md, "Band boards"). Its reads cost the store and the routers the hash
    board's times ``band_store_read_factor`` and ``band_router_read_factor``, its writes times the
    write factors (a total that changes band costs band.lua and settle.lua calls), and a player
    ``band_bytes_per_player`` in all instead of ``bytes_per_player`` on the total: the factors of
    one `make bench`, measured side by side with the hash board of one shard per master.

    ``incr`` is the share of the writes that go to incr boards, whose dedup records stay in memory
    for ``dedup_window_s`` (their boards' window) and a bucket more. ``timeless`` is the share sent
    without ``achieved_at``, each keeping a pin for that window and a pin hash's span more (the CPU
    costs of `make bench` are of such writes). ``journaled`` is the share that
    goes to journaled boards (not ``durability: memory``): their journals may fill to
    ``journal_max_results`` results not yet archived (or ``journal_max_entries`` entries, if that
    comes first) per shard while the archive is down, and each master keeps room
    for its shards' full journals (they do not change the master count: a buffer, not data).
    ``cached`` is the share of the reads the routers answer from their top cache.

    An exact read of a hash board touches every shard, so every primary's group serves a slice of
    EVERY read: one round trip (``redis_node_us_per_read``) plus each of its shards
    (``redis_shard_us_per_read``). Adding masters spreads writes and memory, not reads; the reads
    that fit grow with the nodes of each group that serve them (reads from replicas). So: masters
    for memory and writes, at least MIN_MASTERS (failover), one shard per master (more only past
    MAX_PLAYERS_PER_SHARD), then the readers per group that the reads need.
    """
    c = {**DEFAULTS, **{k: v for k, v in costs.items() if v is not None}}
    banded = sharding == "band"
    router_write = router_write_us(c, scores_per_request)
    router_write *= c["band_router_write_factor"] if banded else 1.0
    router_read = c["router_us_per_read"] * (c["band_router_read_factor"] if banded else 1.0)
    router_cores = (writes * router_write + reads * router_read) / 1e6
    routers = max(1, math.ceil(router_cores / ROUTER_UTILISATION))
    writers = routers
    warnings = []
    if write_routers is not None:
        writers = max(write_routers, write_pool(writes, router_write))
        routers = writers + math.ceil(reads * router_read / 1e6 / ROUTER_UTILISATION)
        if writers > write_routers:  # a pool of the size asked would not hold the writes
            warnings.append(
                f"--write-routers {write_routers} raised to {writers}: the writes take "
                f"{writes * router_write / 1e6:.2f} cores of the routers' CPU, {ROUTER_UTILISATION:g} of a "
                f"core a router; a pool of {write_routers} would not hold them"
            )
    extra = len([p for p in periods if p != "total"])
    base_us = c["redis_master_us_per_write"] * (1 + EXTRA_PERIOD_WRITE_COST * extra)
    base_us *= c["band_store_write_factor"] if banded else 1.0
    dedup = dedup_members(writes, incr, dedup_window_s) * c["bytes_per_dedup_member"] * FRAGMENTATION
    dedup += pins(writes, timeless, dedup_window_s) * c["bytes_per_pin"] * FRAGMENTATION
    per_player = c["bytes_per_player"] * memory_factor(periods)
    if banded:  # the band row and both version hashes come on top of the home shard's rows
        per_player += max(0.0, c["band_bytes_per_player"] - c["bytes_per_player"])
    data = players * per_player * FRAGMENTATION + dedup
    by_memory = math.ceil(data / MAX_DATA_PER_MASTER)
    request_scores = scores_per_request or c["router_scores_per_request"]
    # More masters make more shards, so each router's calls carry fewer scores and cost a master
    # more per write: grow the masters until their writes fit (the cost per write is bounded by a
    # call of one score, so this ends).
    masters = min(MAX_MASTERS, max(MIN_MASTERS, by_memory))
    while True:
        per_master = shards_per_master(players, masters)
        shards = min(MAX_SHARDS, masters * per_master)
        batch = scores_per_call(writes, writers, shards, request_scores)
        write_us = base_us * call_size_factor(c, batch)
        write_us += incr * (DEDUP_BUCKETS + 1) * c["redis_master_us_per_dedup_lookup"]
        write_cores = writes * write_us / 1e6
        by_cpu = math.ceil(write_cores / MASTER_UTILISATION)
        if by_cpu <= masters or masters >= MAX_MASTERS:
            break
        masters = min(MAX_MASTERS, by_cpu)
    warnings += _cap_warnings(players, shards, masters * per_master, by_memory, by_cpu)
    per_master = math.ceil(shards / masters)  # the busiest master's, once the shards are capped
    group_read = (
        reads * (1 - cached) * (c["redis_node_us_per_read"] + per_master * c["redis_shard_us_per_read"])
    )
    group_read *= c["band_store_read_factor"] if banded else 1.0
    group_read /= 1e6  # cores of each primary's group that the reads take
    # Each replica applies its master's writes too (the same calls, replayed), on its own core: the
    # raw run's replica CPU per write, scaled as the master's is (periods, band board, call size).
    scaled = base_us / c["redis_master_us_per_write"] if c["redis_master_us_per_write"] else 1.0
    replica_us = c["redis_replica_us_per_write"] * scaled * call_size_factor(c, batch)
    replica_write = writes / masters * replica_us / 1e6
    read_from, replicas, over = readers(group_read, write_cores / masters, replicas, replica_write)
    if over:  # at the top, not only in the model's reads line (until 2026-12-06)
        warnings.append(
            f"the reads take {group_read:,.1f} cores of each primary's group, more than {MAX_REPLICAS} "
            "replicas a master hold: OVER BUDGET, the plan does NOT hold them; cache more reads in the "
            "routers (--cached, max_age_ms) or split the load over clusters"
        )
    if masters * (1 + replicas) > MAX_CLUSTER_NODES:
        warnings.append(
            f"{masters * (1 + replicas):,} Redis nodes in one cluster, past the {MAX_CLUSTER_NODES:,} "
            "Redis Cluster is built for (every node gossips with the others): split the load over "
            "clusters, or cache more reads in the routers (--cached, max_age_ms)"
        )
    redis_cores = write_cores + group_read * masters + replica_write * masters * replicas
    shards_reason = (
        f"{per_master} per master: a read pays a round trip per node and a little per shard, so "
        f"no more shards than masters need, unless a shard would pass {MAX_PLAYERS_PER_SHARD:,} players"
    )
    shards_reason += (
        "; a board created without a shard count gets this (one per master)"
        if per_master == 1
        else f'; create the board with "sharding": {{"shards": {shards}}} '
        "(without a count it gets one per master)"
    )
    if banded:
        shards_reason = (
            f"home shards, {per_master} per master (what a band board created without a shard count gets"
            f"{'' if per_master == 1 else ' with one per master: give the count'}), and "
            f"{_count(masters, 'band')}, one per master: a band board; set "
            "its band starts with `shardlb bands BOARD --count "
            f"{masters}` (each band about as many players) and keep them so as scores move with "
            "its `--apply` from cron"
        )
    reasons = {
        "masters": _masters_bound(by_memory, by_cpu),
        "shards": shards_reason,
        "reads": _reads_reason(group_read, read_from, replicas, over),
        "sharding": sharding,
    }
    journal_batch = scores_per_call(writes * journaled, writers, shards, request_scores)
    journal = journal_at_bound(
        writes * journaled, shards, per_master, c, journal_max_entries, journal_batch, journal_max_results
    )
    if not journaled:
        journal = Journal(0.0, 0.0, 0.0, 0.0)
    memory_per_node = int((data / masters + journal.bytes_per_master) * FORK_HEADROOM)
    one_cluster = masters * (1 + replicas) <= MAX_CLUSTER_NODES
    fits = not over and max(by_memory, by_cpu) <= MAX_MASTERS and one_cluster
    return Plan(
        masters, replicas, shards, read_from, routers, memory_per_node, data, dedup, redis_cores,
        router_cores, journal, reasons, fits, batch, writers, write_us, tuple(warnings),
    )  # fmt: skip


def _cap_warnings(players: int, shards: int, wanted_shards: int, by_memory: int, by_cpu: int) -> list[str]:
    """What the caps (MAX_MASTERS, MAX_SHARDS) leave short: masters that cannot hold the load, shards
    past MAX_PLAYERS_PER_SHARD."""
    warnings = []
    needed = max(by_memory, by_cpu)
    if needed > MAX_MASTERS:
        what = "writes" if by_cpu >= by_memory else "data"
        warnings.append(
            f"the {what} need {needed:,} masters; one board spreads over at most {MAX_MASTERS:,} masters "
            "(one shard each), which do NOT hold them: split the load over boards or clusters"
        )
    if wanted_shards > shards and players / shards > MAX_PLAYERS_PER_SHARD:
        warnings.append(
            f"a board has at most {MAX_SHARDS:,} shards, so {players / shards:,.0f} players a shard, past "
            f"the {MAX_PLAYERS_PER_SHARD:,} a shard should hold to move and resync in good time"
        )
    return warnings


def _masters_bound(by_memory: int, by_cpu: int) -> str:
    if max(by_memory, by_cpu) < MIN_MASTERS:
        return "minimum"
    return "memory" if by_memory >= by_cpu else "CPU"


def masters_why(p: Plan) -> str:
    """What set the plan's master count: memory, the writes' CPU, or Redis Cluster's minimum."""
    return MIN_MASTERS_WHY if p.reasons["masters"] == "minimum" else f"{p.reasons['masters']}-bound"


def router_write_us(c: dict[str, float], scores_per_request: float | None) -> float:
    """The router's CPU per player-score write at ``scores_per_request`` scores a request:
    router_us_per_write, measured at router_scores_per_request, with a request's own part
    (router_us_per_request) spread over the asked size instead; at least MIN_ROUTER_US_PER_WRITE."""
    if scores_per_request is None:
        return c["router_us_per_write"]
    shift = c["router_us_per_request"] * (1 / scores_per_request - 1 / c["router_scores_per_request"])
    return max(MIN_ROUTER_US_PER_WRITE, c["router_us_per_write"] + shift)


def readers(
    group_read: float, write_share: float, replicas: int, replica_write: float = 0.0
) -> tuple[str, int, bool]:
    """(SHARDLB_READ_FROM, replicas per master, over budget) for a group's read cores: the primary
    alone while it has room for its writes and the reads; else the replicas serve the reads, as many
    as their budget needs (at least ``replicas``), each with its core's budget less what applying
    its master's writes takes (``replica_write`` cores)."""
    if group_read + write_share <= MASTER_UTILISATION:
        return "primary", replicas, False
    room = MASTER_UTILISATION - replica_write
    if room <= 0:
        return "replicas", MAX_REPLICAS, True
    need = math.ceil(group_read / room)
    return "replicas", min(MAX_REPLICAS, max(replicas, need)), need > MAX_REPLICAS


def shards_per_master(players: int, masters: int) -> int:
    """One, or as many as keep every shard within MAX_PLAYERS_PER_SHARD players."""
    return max(1, math.ceil(players / (masters * MAX_PLAYERS_PER_SHARD)))


def _reads_reason(group_read: float, read_from: str, replicas: int, over: bool) -> str:
    reason = f"reads take {group_read:.2f} cores of each primary's group (every read touches every group)"
    if read_from == "primary":
        return f"{reason}: the primaries serve them (SHARDLB_READ_FROM=primary)"
    line = (
        f"{reason}: more than a primary has beside its writes, so {_count(replicas, 'replica')} per master "
        f"serve them, {MASTER_UTILISATION:g} core each less what applying their master's writes takes "
        "(SHARDLB_READ_FROM=replicas; replicas may lag)"
    )
    if over:
        line += f" -- OVER BUDGET even at {MAX_REPLICAS} replicas: cache more reads in the routers"
    return line


def load_costs(path: Path) -> tuple[dict[str, float], str]:
    """(costs, where they came from). Missing or unreadable results fall back to DEFAULTS.

    The dedup costs come from ``dedup.json`` beside ``path`` (`make bench-dedup`) when it is there.
    """
    dedup = _dedup_costs(path.parent / DEDUP_SUMMARY)
    try:
        summary: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        source = f"no bench results at {path}: using the documented defaults (run `make bench`)"
        summary = {}
    else:
        source = f"measured by the bench of {summary.get('started', '?')} ({path})"
    costs = {k: float(v) for k, v in summary.get("costs", {}).items() if isinstance(v, int | float)}
    costs.update(dedup)
    if dedup:
        source += f"; dedup costs from {path.parent / DEDUP_SUMMARY}"
    raw = _raw_scores_per_call(summary)
    if raw:
        costs["raw_scores_per_call"] = raw
    calls = _call_costs(path.parent / LOAD_STEPS_SUMMARY)
    costs.update(calls)
    if calls:
        source += f"; script call costs from {path.parent / LOAD_STEPS_SUMMARY}"
    missing = sorted(set(DEFAULTS) - set(costs))
    if summary and missing:
        source += f"; defaults for {', '.join(missing)}"
    return {**DEFAULTS, **costs}, source


def _raw_scores_per_call(summary: dict[str, Any]) -> float | None:
    """The scores per write script call of the raw run: its scores over its EVALSHA calls, the
    exact retries' (``replayed_items``, which ride the calls but are not counted as written) too."""
    writes = summary.get("raw", {}).get("writes", {})
    calls = writes.get("cpu", {}).get("commands", {}).get("evalsha", {}).get("calls")
    items, replayed = writes.get("items"), writes.get("replayed_items", 0)
    if isinstance(calls, int) and calls > 0 and isinstance(items, int | float) and items > 0:
        return round((items + (replayed if isinstance(replayed, int | float) else 0)) / calls, 2)
    return None


def _call_costs(path: Path) -> dict[str, float]:
    """redis_master_us_per_call and redis_master_us_per_score_in_call from `make bench-load-steps`
    (its library steps of 1 and 100 matches a batch on the CALL_COST_SHARDS board)."""
    try:
        result: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    found = result.get("call_costs", {}).get(CALL_COST_SHARDS, {})
    names = ("redis_master_us_per_call", "redis_master_us_per_score_in_call")
    if not all(isinstance(found.get(n), int | float) for n in names):
        return {}
    return {n: float(found[n]) for n in names}


def _dedup_costs(path: Path) -> dict[str, float]:
    """bytes_per_dedup_member, bytes_per_pin and the CPU of one dedup lookup (the slope between the
    bucket counts)."""
    try:
        result: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for name in ("bytes_per_dedup_member", "bytes_per_pin"):
        if isinstance(result.get(name), int | float):
            out[name] = float(result[name])
    cpu = sorted(
        (c["lookups"], c["redis_us_per_result"])
        for c in result.get("cpu", [])
        if isinstance(c, dict)
        and isinstance(c.get("lookups"), int)
        and isinstance(c.get("redis_us_per_result"), int | float)
    )
    if len(cpu) >= 2 and cpu[-1][0] > cpu[0][0]:
        slope = (cpu[-1][1] - cpu[0][1]) / (cpu[-1][0] - cpu[0][0])
        out["redis_master_us_per_dedup_lookup"] = round(max(0.0, slope), 3)
    return out


@dataclass(frozen=True)
class Step:
    """One change from today's layout towards the plan's: what and why, and the commands that make it."""

    what: str
    commands: tuple[str, ...]


def layout_steps(
    p: Plan, masters_now: int | None, shards_now: int | None, board: str = "BOARD"
) -> list[Step]:
    """The changes from today's layout (``masters_now`` masters, ``board`` on ``shards_now`` shards;
    None: not given) to the plan's, in the order to make them. Masters come first when the plan has
    more, so the new shards have masters to land on (a shard's slot sits in its N-th of the slots);
    when it has fewer, the reshard comes first and removing masters after it is optional: fewer
    cost less, but other boards and data may need them. Last, where the board's shard count is
    known, a check of where its shards landed."""
    steps: list[Step] = []
    nodes = p.masters * (1 + p.replicas)
    extra = 0 if masters_now is None else p.masters - masters_now
    if extra > 0:
        times = f"   ({extra} times)" if extra > 1 else ""
        steps.append(
            Step(
                f"add {_count(extra, 'master')}, {masters_now} -> {p.masters} ({masters_why(p)}), "
                f"{_count(p.replicas, 'replica')} each, and move their share of the slots onto them (online)",
                (
                    f"local:      shardlb cluster add-node --replicas {p.replicas}{times}",
                    "            shardlb cluster rebalance",
                    f"Kubernetes: kubectl -n NS scale statefulset/redis-cluster --replicas={nodes}; for each "
                    "new master redis-cli --cluster add-node, its replicas with --cluster-slave",
                    "            --cluster-master-id; then redis-cli --cluster rebalance $SEED "
                    f"--cluster-use-empty-masters ({K8S_STEP})",
                ),
            )
        )
    if p.replicas > 1:
        # --masters-now counts masters alone: today's may have fewer replicas than the plan's (the
        # clusters of `make run` and k8s/base have one each), and adding masters gives only the new
        # ones theirs.
        steps.append(
            Step(
                f"give every master {p.replicas} replicas ({p.nodes} Redis nodes in all; "
                f"SHARDLB_READ_FROM={p.read_from}): the reads need them; skip the masters that have them",
                (
                    f"local:      shardlb cluster add-node --replicas {p.replicas} gives a new master its "
                    f"own; a cluster formed with `shardlb cluster up --replicas {p.replicas}` has them",
                    f"Kubernetes: kubectl -n NS scale statefulset/redis-cluster --replicas={p.nodes}; for "
                    "each new node redis-cli --cluster add-node NEW $SEED --cluster-slave",
                    f"            --cluster-master-id <the master short of replicas> ({K8S_STEP})",
                ),
            )
        )
    banded = p.reasons.get("sharding") == "band"
    if banded and shards_now is not None:
        steps.append(
            Step(
                f"make {board} a band board online: {_count(shards_now, 'hash shard')} -> "
                f"{_count(p.shards, 'home shard')} and {_count(p.masters, 'band')}, one per master "
                "(a rank reads the sizes of the bands ahead and one band; skip if it already is one)",
                (
                    f"shardlb bands {board} --count {p.masters}   (band starts at the board's rank "
                    "quantiles; it prints the reshard that applies them:)",
                    f"shardlb reshard {board} --shards {p.shards} --bands <those starts>   (writes and exact "
                    "reads go on; --status, --resume, --cancel as for any reshard)",
                    f"on Kubernetes: kubectl -n NS exec deploy/shardlb-archiver -- shardlb bands {board} "
                    f"--count {p.masters}, then the reshard it prints",
                    f"then keep the bands even as scores move: shardlb bands {board} --count {p.masters} "
                    f"--apply from cron (the shardlb-bands CronJob: "
                    f"SHARDLB_BANDS_BOARDS={board}:{p.masters})",
                ),
            )
        )
    elif shards_now is not None and shards_now != p.shards:
        why = (
            "to spread its writes over every master"
            if p.shards > shards_now
            else "a read pays a round trip per node and a little per shard"
        )
        steps.append(
            Step(
                f"reshard {board} online, {shards_now} -> {_count(p.shards, 'shard')} ({why}; hash boards)",
                (
                    f"shardlb reshard {board} --shards {p.shards}   (writes and exact reads go on; --status "
                    "shows progress and the time left, --resume goes on after a crash, --cancel before the "
                    "cut-over)",
                    f'or POST /v1/admin/boards/{board}/reshard {{"shards": {p.shards}}}; on Kubernetes:',
                    "kubectl -n NS exec deploy/shardlb-archiver -- "
                    f"shardlb reshard {board} --shards {p.shards}",
                ),
            )
        )
    if extra < 0:
        steps.append(
            Step(
                f"optional: the load needs {_count(p.masters, 'master')} of today's {masters_now}; to give "
                f"{-extra} back, empty them and take them out (only if no other board or data needs them)",
                (
                    "local:      shardlb cluster remove-node PORT   (each master to go: its slots move to "
                    "the others)",
                    "Kubernetes: redis-cli --cluster rebalance $SEED --cluster-weight <node-id>=0 for each "
                    "(the highest ordinals: a StatefulSet removes those),",
                    "            redis-cli --cluster del-node for it and its replicas, then kubectl -n NS "
                    f"scale statefulset/redis-cluster --replicas={nodes} ({K8S_STEP})",
                ),
            )
        )
    if steps and shards_now is not None:
        each = f"{p.shards // p.masters} of {board}'s shards"
        if banded:
            each = f"{p.shards // p.masters} of {board}'s home shards and one of its bands"
        steps.append(
            Step(
                f"check that every master serves {each}",
                ("local:      shardlb cluster status   (each board's shards per master)",),
            )
        )
    return steps


def _steps_lines(steps: list[Step], p: Plan, masters_now: int | None, shards_now: int | None) -> list[str]:
    today = "; ".join(
        part
        for part in (
            _count(masters_now, "master") if masters_now is not None else "",
            f"the board on {_count(shards_now, 'shard')}" if shards_now is not None else "",
        )
        if part
    )
    if not steps:
        return [f"Today's layout ({today}) is the plan's: nothing to change.", ""]
    plan = f"{_count(p.masters, 'master')}; {_count(p.shards, 'shard')}"
    lines = [f"From today's layout ({today}) to the plan's ({plan}):"]
    for n, step in enumerate(steps, start=1):
        lines.append(f"  {n}. {step.what}")
        lines.extend(f"       {command}" for command in step.commands)
    if shards_now is None:
        lines.append(
            f"  (the plan puts a board on {_count(p.shards, 'shard')}: --shards-now prints its reshard)"
        )
    return [*lines, ""]


def _writers(n: int) -> str:
    return f"; {n} of them {'takes' if n == 1 else 'take'} the writes"


def _count(n: float, noun: str) -> str:
    """``n`` and its noun, plural unless ``n`` is one (`process` takes `es`); a float as ``:g``
    prints it."""
    shown = f"{n:g}" if isinstance(n, float) else str(n)
    return f"{shown} {noun}" if n == 1 else f"{shown} {noun}{'es' if noun.endswith('s') else 's'}"


def scaleout_lines(result: dict[str, Any]) -> list[str]:
    """What `make bench-scaleout` measured on 1, 2, 3... masters beside the model's assumptions: a
    write costs the one master of its shard (the busiest master's share falls as 1/masters), an
    exact read costs every master (each master's cost per read stays)."""
    points = [
        p
        for p in result.get("points", [])
        if isinstance(p, dict)
        and isinstance(p.get("masters"), int)
        and p.get("writes", {}).get("redis_us_per_op")
        and p.get("reads", {}).get("redis_us_per_op")
    ]
    if len(points) < 2:
        return []

    writes = [p["writes"]["redis_us_per_op"] for p in points]
    reads = [p["reads"]["redis_us_per_op"] for p in points]
    masters = " / ".join(str(p["masters"]) for p in points)
    write_all = " / ".join(f"{sum(w):.1f}" for w in writes)
    busiest = " / ".join(f"{max(w) / sum(w):.2f}" for w in writes)
    model = " / ".join(f"{1 / p['masters']:.2f}" for p in points)
    read_each = " / ".join(f"{sum(r) / len(r):.1f}" for r in reads)
    read_all = " / ".join(f"{sum(r):.1f}" for r in reads)
    cpus = result.get("machine", {}).get("cpus", "?")
    return [
        f"Scale-out measured by `make bench-scaleout` ({result.get('name', '?')}; {masters} masters, no "
        f"replicas, on {cpus} CPUs shared by the masters and the load generator: the per-master costs "
        "count, not the rates):",
        f"  Redis µs per write, all masters: {write_all}; the busiest master's share: {busiest} (the "
        f"model: 1/masters, {model})",
        f"  Redis µs per read, each master (mean): {read_each}; all masters: {read_all} (the model: every "
        "exact read costs every master's group a round trip)",
        *_band_scaleout(points),
    ]


def _band_scaleout(points: list[dict[str, Any]]) -> list[str]:
    """The band board's reads of the same sweep, when it measured them."""
    reads = [p.get("band_reads", {}).get("redis_us_per_op") for p in points]
    if not all(reads):
        return []
    busiest = " / ".join(f"{max(r):.1f}" for r in reads)
    rest = " / ".join(f"{(sum(r) - max(r)) / (len(r) - 1):.1f}" if len(r) > 1 else "-" for r in reads)
    lines = [
        f"  band board, Redis µs per read, the busiest master: {busiest}; the others (mean): {rest} (the "
        "player's home shard and band walk a skip list, every other band answers O(1) counts; the model "
        "scales the hash board's read per group by band_store_read_factor)",
    ]
    kept = [p.get("band_reads_kept", {}).get("redis_us_per_op") for p in points]
    if all(kept):
        lines.append(
            '  band board, "my rank" with max_age_ms, Redis µs per read, all masters: '
            + " / ".join(f"{sum(r):.1f}" for r in kept)
            + "; the busiest: "
            + " / ".join(f"{max(r):.1f}" for r in kept)
            + " (two shards a read: the other bands' sizes up to that old; not in the model, which "
            "sizes exact reads)"
        )
    return lines


def _scaleout(path: Path) -> list[str]:
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return scaleout_lines(result) if isinstance(result, dict) else []


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _gib_up(n: float) -> float:
    """``n`` bytes rounded up to a tenth of a GiB, as ``_gib`` prints it: a figure an operator sets
    as a limit (maxmemory, a container's memory) must hold what the plan counted, not round below it."""
    return math.ceil(round(n / 2**30 * 10, 6)) / 10 * 2**30


def _size(n: float) -> str:
    return _gib(n) if n >= 2**30 else f"{n / 2**20:.0f} MiB"


ASSUMPTIONS = (
    "  - the per-operation costs scale linearly from the bench (same read mix, same players",
    "    per match, same script); an exact read touches every shard, paying a round trip per node",
    "    and a little per shard;",
    "  - dated periods keep, alive at once and active: "
    + "; ".join(f"{k} {n} sets x {a:.0%}" for k, (n, a) in PERIOD_SETS.items())
    + ";",
    "  - replicas hold the same memory and add redis_replica_us_per_write on their own cores; reads",
    "    from replicas may miss the last moments' writes (replication lag);",
    "  - with fewer shards than masters, the extra masters take no part of a board's writes: create",
    "    it with as many shards as the plan says, or reshard it online (`shardlb reshard`, hash boards;",
    "    --masters-now and --shards-now print the steps from today's layout);",
    "  - a 2-core bench machine shares its cores between everything, and a round trip there costs",
    "    far more system time than on dedicated hosts: treat its costs as upper bounds, and re-run",
    "    `make bench` on hardware like production's before buying it.",
)


def render(
    p: Plan,
    players: int,
    writes: float,
    reads: float,
    periods: list[str],
    costs: dict[str, float],
    source: str,
    incr: float = 0.0,
    dedup_window_s: int = DEFAULT_DEDUP_WINDOW_S,
    journaled: float = 1.0,
    journal_max_entries: int = JOURNAL_MAX_ENTRIES,
    cached: float = CACHED_SHARE,
    steps: Sequence[str] = (),
    measured: Sequence[str] = (),
    timeless: float = 0.0,
    scores_per_request: float | None = None,
    journal_max_results: int = JOURNAL_MAX_RESULTS,
) -> str:
    """The plan, ``steps`` from today's layout to it, the costs it used, the model with its figures,
    what ``measured`` scale-out says beside it, and the assumptions behind it."""
    nodes = p.masters * (1 + p.replicas)
    # Rounded up (until 2026-12-06 to the nearest tenth, which could fall below the journals), and
    # the node's memory printed as twice the printed maxmemory, as the overlays set the two.
    maxmemory = _gib_up(p.data_bytes / p.masters + p.journal.bytes_per_master)
    return "\n".join(
        [
            f"Plan for {players:,} players, {writes:,.0f} player-score writes/s ({incr:.0%} to incr boards, "
            f"{timeless:.0%} without achieved_at, dedup window {dedup_window_s / 3600:g} h; "
            f"{journaled:.0%} journaled), {reads:,.0f} reads/s, "
            f"periods {','.join(periods)}, {cached:.0%} of the reads from the routers' top cache",
            "",
            f"  layout               {p.reasons['sharding']} board  ({p.reasons.get('chosen', 'as asked')})",
            *(f"  WARNING: {w}" for w in p.warnings),
            f"  Redis masters        {p.masters}  ({masters_why(p)}; {nodes} nodes with replicas)",
            f"  replicas per master  {p.replicas}",
            f"  reads from           {p.read_from}  (SHARDLB_READ_FROM)",
            f"  shards per board     {p.shards}  ({p.reasons['shards']})",
            f"  router processes     {p.routers}  (one core each"
            f"{'' if p.write_routers == p.routers else _writers(p.write_routers)})",
            f"  memory per node      {_gib(FORK_HEADROOM * maxmemory)}  "
            f"(data {_gib(p.data_bytes / p.masters)} + full journals {_size(p.journal.bytes_per_master)} "
            f"per master x {FORK_HEADROOM:g} for fork copy-on-write)",
            f"  maxmemory            {_gib(maxmemory)} per master, policy noeviction (a full master "
            "refuses writes: 503 out_of_memory)",
            f"  journal bound        {_journal_line(p.journal, journal_max_entries, journal_max_results)}",
            f"  PostgreSQL disk      {_archive_line(writes * journaled, costs)}",
            "",
            *steps,
            f"Costs: {source}",
            *(f"  {k} = {v:g}" for k, v in sorted(costs.items())),
            "",
            "Model:",
            *_model(p, writes, periods, costs, incr, dedup_window_s, cached, timeless, scores_per_request),
            f"  journal = shards per master x (results x bytes_per_journaled_result + entries x "
            f"bytes_per_journal_entry) x {FRAGMENTATION:g}, where results = the smaller of "
            f"{journal_max_results:,} and {journal_max_entries:,} entries x results per entry, and entries = "
            "results / results per entry; an entry is one write script call, so results per entry = scores "
            "a write call (above) at the journaled writes; the bound holds results / journaled writes a "
            "shard seconds of writes",
            "",
            *([*measured, ""] if measured else []),
            "Assumptions:",
            *ASSUMPTIONS,
        ]
    )


def _model(
    p: Plan,
    writes: float,
    periods: list[str],
    costs: dict[str, float],
    incr: float,
    dedup_window_s: int,
    cached: float,
    timeless: float = 0.0,
    scores_per_request: float | None = None,
) -> list[str]:
    """The model's formulas with this plan's figures, so that each can be checked by hand."""
    members = dedup_members(writes, incr, dedup_window_s)
    pinned = pins(writes, timeless, dedup_window_s)
    pin_bytes = pinned * costs["bytes_per_pin"] * FRAGMENTATION
    dedup_line = (
        f"  dedup = writes x {incr:g} incr share x {dedup_window_s:,} s window x {DEDUP_LIFETIME:.3f} "
        f"(one window and one of {DEDUP_BUCKETS} buckets) = {members:,.0f} records x "
        f"bytes_per_dedup_member x {FRAGMENTATION:g} = {_gib(p.dedup_bytes - pin_bytes)}"
    )
    pin_line = (
        f"  pins = writes x {timeless:g} share without achieved_at x {dedup_window_s:,} s window x "
        f"{PIN_LIFETIME:.3f} (one window and {PIN_SPAN} of {DEDUP_BUCKETS} buckets) = {pinned:,.0f} pins x "
        f"bytes_per_pin x {FRAGMENTATION:g} = {_gib(pin_bytes)}"
    )
    if timeless == 0:
        everything = pins(writes, 1.0, dedup_window_s) * costs["bytes_per_pin"] * FRAGMENTATION
        pin_line += f" (with --timeless 1, no write sending its time: {_gib(everything)})"
    if incr == 0:
        per_member = costs["bytes_per_dedup_member"] * FRAGMENTATION
        everything = dedup_members(writes, 1.0, dedup_window_s) * per_member
        dedup_line += f" (with --incr 1, every write to incr boards: {_gib(everything)})"
    band = (
        [
            "  band board: the store's w and reads per group x band_store_write_factor and "
            "band_store_read_factor, the routers' x band_router_write_factor and band_router_read_factor; "
            "a player's bytes + (band_bytes_per_player - bytes_per_player) for the band row and versions"
        ]
        if p.reasons.get("sharding") == "band"
        else []
    )
    return [
        *band,
        *_call_lines(p, writes, costs, scores_per_request),
        f"  w = redis_master_us_per_write x call size factor x (1 + {EXTRA_PERIOD_WRITE_COST:g} per "
        f"extra period) + incr share x {DEDUP_BUCKETS + 1} x redis_master_us_per_dedup_lookup = "
        f"{p.write_us:.1f} us; "
        f"masters = max(writes x w / {MASTER_UTILISATION:g} core, data / {_gib(MAX_DATA_PER_MASTER)}, "
        f"{MIN_MASTERS})",
        f"  every read touches every primary's group: reads x (1 - {cached:g} cached) x "
        "(redis_node_us_per_read + shards per master x redis_shard_us_per_read) per group, served by the "
        f"primary (beside its writes) or by the replicas, {MASTER_UTILISATION:g} core each less "
        "writes / masters x redis_replica_us_per_write x the master's scaling (periods, band, call size)",
        f"  {p.reasons['reads']}",
        f"  Redis CPU in all = {p.redis_cores:.2f} cores",
        f"  data = players x bytes_per_player x {memory_factor(periods):.2f} (entries per player for the "
        f"periods) x {FRAGMENTATION:g} fragmentation + dedup + pins = {_gib(p.data_bytes)}",
        dedup_line,
        pin_line,
        *_request_line(costs, scores_per_request),
        "  router CPU = writes x router_us_per_write + reads x router_us_per_read"
        f" = {p.router_cores:.2f} cores;"
        f" routers = that / {ROUTER_UTILISATION:g}",
    ]


def _call_lines(
    p: Plan, writes: float, costs: dict[str, float], scores_per_request: float | None
) -> list[str]:
    """How big the routers' write calls are at this plan, and what that does to a master's CPU per
    write; with a hint when the calls are small enough for their fixed part to dominate."""
    c = {**DEFAULTS, **costs}
    scores = scores_per_request or c["router_scores_per_request"]
    factor = call_size_factor(c, p.scores_per_call)
    touched = touched_shards(scores, p.shards)
    lines = [
        f"  scores a write call = a request's {_count(scores, 'score')} / the {touched:.1f} of "
        f"{p.shards} shards it touches + writes / {_count(p.write_routers, 'router')} taking writes / "
        f"{p.shards} shards x "
        f"{COALESCE_DELAY_S * 1000:g} ms coalescing delay = {p.scores_per_call:.1f}; call size factor = "
        f"(redis_master_us_per_score_in_call + redis_master_us_per_call / {p.scores_per_call:.1f}) / "
        f"(the same at raw_scores_per_call) = {factor:.2f}",
    ]
    if factor > 1.5 and writes:
        pool = write_pool(writes, router_write_us(c, scores_per_request))
        fewer = (
            f", or a pool of fewer routers taking the writes (--write-routers {pool}: the fewest whose "
            "CPU holds them)"
            if pool < p.write_routers
            else ""
        )
        lines.append(
            f"  calls of {p.scores_per_call:.1f} scores cost the masters {factor:.1f}x a score of the "
            "bench's calls: more scores a request (--scores-per-request; the Python client's ScoreBuffer "
            "gathers them), a longer "
            f"SHARDLB_COALESCE_DELAY_MS{fewer} make them bigger"
        )
    return lines


def _pool_lines(shared: Plan, pooled: Plan) -> list[str]:
    """The same load with a pool of routers that take only the writes, when it needs fewer nodes."""
    if pooled.nodes >= shared.nodes:
        return []
    return [
        f"With a pool of {_count(pooled.write_routers, 'router')} that take the score writes "
        f"(--write-routers {pooled.write_routers}; the game servers post their scores to that pool's "
        "address, every other request goes to the rest), each router's write calls carry "
        f"{pooled.scores_per_call:.1f} scores instead of {shared.scores_per_call:.1f}, and the same load "
        f"takes {_count(pooled.nodes, 'Redis node')} ({pooled.masters} masters x "
        f"{_count(pooled.replicas, 'replica')}) and {_count(pooled.routers, 'router process')} "
        f"instead of {shared.nodes} and {shared.routers}.",
        "",
    ]


def _request_line(costs: dict[str, float], scores_per_request: float | None) -> list[str]:
    """The routers' CPU per write at the asked request size (``router_write_us``), if one was asked."""
    if scores_per_request is None:
        return []
    c = {**DEFAULTS, **costs}
    return [
        f"  router_us_per_write at {_count(scores_per_request, 'score')} a request = router_us_per_write "
        f"+ router_us_per_request x (1/{scores_per_request:g} - 1/{c['router_scores_per_request']:g}) = "
        f"{router_write_us(c, scores_per_request):.1f} us (at least {MIN_ROUTER_US_PER_WRITE:g})"
    ]


def archive_bytes_per_day(journaled_writes: float, costs: dict[str, float]) -> float:
    """The bytes the archive's results grow by in a day of ``journaled_writes`` a second (each write
    one result, each result one row of match_results with its indexes)."""
    return journaled_writes * 86_400 * costs["bytes_per_archived_result"]


def _archive_line(journaled_writes: float, costs: dict[str, float]) -> str:
    if not journaled_writes:
        return "none (no journaled board)"
    return (
        f"{_size(archive_bytes_per_day(journaled_writes, costs))} a day of archived results at these writes "
        "all day (journaled writes/s x 86,400 x bytes_per_archived_result); kept as long as their board "
        "lives, removed by `shardlb prune` once it is deleted"
    )


def _journal_line(j: Journal, max_entries: int, max_results: int = JOURNAL_MAX_RESULTS) -> str:
    if not j.bytes_per_master:
        return "none (no journaled board)"
    per_entry = f"{j.results_per_entry:,.1f}" if j.results_per_entry < 10 else f"{j.results_per_entry:,.0f}"
    reached = (
        f"{max_results:,} results (SHARDLB_JOURNAL_MAX_RESULTS)"
        if j.bound == "results"
        else f"{max_entries:,} entries (SHARDLB_JOURNAL_MAX_ENTRIES), {j.results:,.0f} results"
    )
    line = f"{_size(j.bytes_per_master)} per master at {reached} a shard in entries of {per_entry} results "
    line += f"({_size(j.bytes_per_shard)} a shard); "
    if math.isinf(j.buffer_s):
        return line + "no journaled writes: the bound is never reached"
    line += (
        f"at this rate the bound holds {j.buffer_s:,.0f} s of writes while PostgreSQL or the archiver is "
        "down, then writes get 503"
    )
    if j.buffer_s < JOURNAL_HOLD_S:
        results = math.ceil(j.results * JOURNAL_HOLD_S / j.buffer_s / 1000 - 1e-9) * 1000
        entries = math.ceil(results / j.results_per_entry / 1000) * 1000
        flags = f"--journal-max-results {results:,} (SHARDLB_JOURNAL_MAX_RESULTS)"
        if entries > max_entries:
            flags += f" and --journal-max-entries {entries:,} (SHARDLB_JOURNAL_MAX_ENTRIES)"
        line += (
            f"; to hold {JOURNAL_HOLD_S // 60:g} minutes, {flags}: "
            f"{_size(j.bytes_per_master * results / j.results)} per master"
        )
    return line


def main(argv: list[str] | None = None) -> int:
    """`plan --players N --writes W --reads R [--replicas 1] [--periods total,daily,...] [--incr S]
    [--timeless S] [--dedup-window SECONDS]`."""
    parser = argparse.ArgumentParser(prog="shardlb plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--players", type=int, required=True, help="players on the largest board")
    parser.add_argument("--writes", type=float, required=True, help="player-score writes a second at peak")
    parser.add_argument("--reads", type=float, required=True, help="reads a second at peak (the bench's mix)")
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="replicas per master at least (default 1; more if reads need them)",
    )
    parser.add_argument(
        "--cached",
        type=float,
        default=CACHED_SHARE,
        help=f"share of the reads the routers' top cache answers, 0 to 1 (default {CACHED_SHARE:g}: "
        "the mix's top-100)",
    )
    parser.add_argument(
        "--periods", default="total", help="kept periods, e.g. total,daily,weekly (default total)"
    )
    parser.add_argument(
        "--incr",
        type=float,
        default=0.0,
        help="share of the writes that go to incr boards, 0 to 1 (default 0); each keeps a dedup record",
    )
    parser.add_argument(
        "--timeless",
        type=float,
        default=0.0,
        help="share of the writes sent without achieved_at, 0 to 1 (default 0); each keeps a pin",
    )
    parser.add_argument(
        "--dedup-window",
        type=int,
        default=DEFAULT_DEDUP_WINDOW_S,
        help=f"the boards' dedup_window_s (default {DEFAULT_DEDUP_WINDOW_S}): how long dedup records "
        "and pins live",
    )
    parser.add_argument(
        "--journaled",
        type=float,
        default=1.0,
        help="share of the writes that go to journaled boards (not durability: memory), 0 to 1 (default 1)",
    )
    parser.add_argument(
        "--journal-max-results",
        type=int,
        default=JOURNAL_MAX_RESULTS,
        help=f"the routers' SHARDLB_JOURNAL_MAX_RESULTS (default {JOURNAL_MAX_RESULTS:,})",
    )
    parser.add_argument(
        "--journal-max-entries",
        type=int,
        default=JOURNAL_MAX_ENTRIES,
        help=f"the routers' SHARDLB_JOURNAL_MAX_ENTRIES (default {JOURNAL_MAX_ENTRIES:,})",
    )
    parser.add_argument(
        "--masters-now",
        type=int,
        help="masters in the cluster today: print the steps to add (or remove) masters",
    )
    parser.add_argument(
        "--shards-now",
        type=int,
        help="shards of the board today: print the reshard to the plan's shard count (hash boards)",
    )
    parser.add_argument(
        "--sharding",
        choices=("auto", *SHARDINGS),
        default="auto",
        help="the board's layout: hash, band (one band per master; cheaper reads, dearer writes), or auto "
        "(default: plan both, recommend the one that fits on the fewest nodes)",
    )
    parser.add_argument(
        "--scores-per-request",
        type=float,
        help="player-scores the game servers post in a request, 1 to 1000 (default: the bench's, a "
        "match of 10); a request's own router cost is spread over them",
    )
    parser.add_argument(
        "--write-routers",
        type=int,
        help="routers that take the score writes, the others the reads (default: every router takes "
        "both); fewer routers make each one's write calls bigger, which costs the masters less a score",
    )
    parser.add_argument("--board", default="BOARD", help="the board's name in the printed steps")
    parser.add_argument(
        "--summary",
        type=Path,
        help=f"bench summary to read (default {LATEST}, or the documented costs where it is absent)",
    )
    args = parser.parse_args(argv)
    periods = [p.strip() for p in args.periods.split(",") if p.strip()]
    unknown = sorted(set(periods) - {"total", *PERIOD_SETS})
    for flag, rate in (("--writes", args.writes), ("--reads", args.reads)):
        if not (math.isfinite(rate) and 0 <= rate <= MAX_RATE):
            parser.error(f"{flag} is a rate a second: a finite number, 0 to {MAX_RATE:g} (got {rate:g})")
    if unknown:
        parser.error(f"--periods: unknown periods {', '.join(unknown)} (total, {', '.join(PERIOD_SETS)})")
    if not 1 <= args.players <= MAX_PLAYERS:
        parser.error(f"--players is the players on a board: 1 to {MAX_PLAYERS:,}")
    if not 0 <= args.replicas <= MAX_REPLICAS:
        parser.error(f"--replicas is replicas per master: 0 to {MAX_REPLICAS}")
    if not 0 <= args.incr <= 1:
        parser.error("--incr is a share of the writes, from 0 to 1")
    if not 0 <= args.timeless <= 1:
        parser.error("--timeless is a share of the writes, from 0 to 1")
    if not 60 <= args.dedup_window <= 30 * 86_400:
        parser.error("--dedup-window is a board's dedup_window_s: 60 to 2592000 seconds")
    if not 0 <= args.cached <= 1:
        parser.error("--cached is a share of the reads, from 0 to 1")
    if not 0 <= args.journaled <= 1:
        parser.error("--journaled is a share of the writes, from 0 to 1")
    if not 1 <= args.journal_max_results <= MAX_JOURNAL_RESULTS:
        parser.error(
            f"--journal-max-results is the routers' SHARDLB_JOURNAL_MAX_RESULTS: 1 to {MAX_JOURNAL_RESULTS:,}"
        )
    if not 1 <= args.journal_max_entries <= MAX_JOURNAL_ENTRIES:
        parser.error(
            f"--journal-max-entries is the routers' SHARDLB_JOURNAL_MAX_ENTRIES: 1 to {MAX_JOURNAL_ENTRIES:,}"
        )
    if args.masters_now is not None and not 1 <= args.masters_now <= SLOTS:
        parser.error(f"--masters-now is a number of masters: 1 to {SLOTS:,} (a cluster's slots)")
    if args.shards_now is not None and not 1 <= args.shards_now <= 1024:
        parser.error("--shards-now is a board's shard count, from 1 to 1024")
    if args.scores_per_request is not None and not 1 <= args.scores_per_request <= 1000:
        parser.error("--scores-per-request is a request's size: 1 to 1000 scores (the API's limit)")
    if args.write_routers is not None and not 1 <= args.write_routers <= MAX_WRITE_ROUTERS:
        parser.error(f"--write-routers is a number of router processes: 1 to {MAX_WRITE_ROUTERS:,}")
    if "total" not in periods:
        periods.insert(0, "total")
    if args.summary is None:
        args.summary = LATEST
    elif not args.summary.is_file():
        # Named, it is the run the plan is meant to price: until 2026-12-06 a mistyped path gave a
        # plan on the default costs, exit 0, said only in the Costs line.
        parser.error(f"--summary: no such file: {args.summary} (a bench run's summary.json)")
    costs, source = load_costs(args.summary)
    load = (
        args.players, args.writes, args.reads, args.replicas, periods, costs, args.incr, args.dedup_window,
        args.journaled, args.journal_max_entries, args.cached, args.timeless,
    )  # fmt: skip
    layouts = SHARDINGS if args.sharding == "auto" else (args.sharding,)
    plans = {
        sharding: plan(
            *load,
            sharding=sharding,
            scores_per_request=args.scores_per_request,
            write_routers=args.write_routers,
            journal_max_results=args.journal_max_results,
        )
        for sharding in layouts
    }
    chosen, why = choose(plans) if len(plans) > 1 else (args.sharding, "as asked")
    p = plans[chosen]
    p.reasons["chosen"] = why
    steps: list[str] = []
    if args.write_routers is None:
        router_write = router_write_us({**DEFAULTS, **costs}, args.scores_per_request)
        pool = write_pool(args.writes, router_write)
        if pool < p.write_routers:
            pooled = plan(
                *load,
                sharding=chosen,
                scores_per_request=args.scores_per_request,
                write_routers=pool,
                journal_max_results=args.journal_max_results,
            )
            steps = _pool_lines(p, pooled)
    if args.masters_now is not None or args.shards_now is not None:
        found = layout_steps(p, args.masters_now, args.shards_now, args.board)
        steps += _steps_lines(found, p, args.masters_now, args.shards_now)
    print(
        render(
            p,
            args.players,
            args.writes,
            args.reads,
            periods,
            costs,
            source,
            args.incr,
            args.dedup_window,
            args.journaled,
            args.journal_max_entries,
            args.cached,
            steps,
            _scaleout(args.summary.parent / SCALEOUT_SUMMARY),
            args.timeless,
            args.scores_per_request,
            args.journal_max_results,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
