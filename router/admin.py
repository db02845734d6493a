"""Admin-only JSON the dashboard needs and the /v1 API does not give: the cluster's nodes and
state, where each shard of a board lives, and the router's own request counters.

Each answer is a snapshot. Rates and latency percentiles are left to the reader, who takes two
snapshots and divides the difference by the time between them (router/static/dashboard/app.js):
the router keeps no history, so any number of dashboards cost it nothing between their polls.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router import http, metrics, params, reshards, routes, scores
from router.auth import Scope
from router.media import read_object, render
from router.service import Service
from shardlb import keys, times
from shardlb.board import band_skew
from shardlb.config import MAX_SHARDS, check_id
from shardlb.errors import BoardConflict, ClusterUnavailable, InvalidInput, unknown_field
from shardlb.reads import View
from shardlb.reshard import Resharder

log = logging.getLogger("shardlb.router")

# The operations a game's traffic is made of, by (method, route template) as the metrics label them
# (board admin, moderation and these admin reads are neither).
WRITES = frozenset({("POST", scores.PATH)})
READS = frozenset(
    {
        ("GET", "/v1/boards/{board}/top"),
        ("GET", "/v1/boards/{board}/entries"),
        ("GET", "/v1/boards/{board}/players/{player}"),
        ("GET", "/v1/boards/{board}/players/{player}/around"),
        ("POST", "/v1/boards/{board}/players:query"),
    }
)
NODE_WAIT_S = 2.0  # per node asked: a stuck node must not hold the page for the client's whole retry
MEMORY_FIELDS = {
    "used": "used_memory",
    "peak": "used_memory_peak",
    "rss": "used_memory_rss",
    "max": "maxmemory",
}


def _admin(request: Request) -> Service:
    svc = routes.service(request)
    peer = request.client.host if request.client else "unknown"
    svc.keys.require(request.headers.get("authorization"), peer, Scope.ADMIN)
    return svc


def slot_owners(nodes: dict[str, dict[str, Any]]) -> list[tuple[int, int, str]]:
    """(first slot, last slot, primary address) of every slot range CLUSTER NODES lists, sorted."""
    owned = [
        (int(r[0]), int(r[-1]), address)
        for address, node in nodes.items()
        if "master" in node["flags"]
        for r in node["slots"]
    ]
    return sorted(owned)


def owner_of(slot: int, owned: list[tuple[int, int, str]]) -> str | None:
    return next((address for first, last, address in owned if first <= slot <= last), None)


def node_rows(nodes: dict[str, dict[str, Any]], memory: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per node of CLUSTER NODES, primaries first, with its slots and INFO memory."""
    by_id = {node["node_id"]: address for address, node in nodes.items()}
    rows = []
    for address, node in nodes.items():
        primary = "master" in node["flags"]
        ranges = [[int(r[0]), int(r[-1])] for r in node["slots"]]
        info = memory.get(address, {})
        rows.append(
            {
                "address": address,
                "id": node["node_id"],
                "role": "primary" if primary else "replica",
                "primary": None if primary else by_id.get(node["master_id"]),
                "slots": sum(last - first + 1 for first, last in ranges),
                "ranges": ranges,
                "connected": bool(node["connected"]),
                "failing": "fail" in node["flags"].split(","),
                "memory": {name: info.get(field) for name, field in MEMORY_FIELDS.items()},
            }
        )
    return sorted(rows, key=lambda r: (r["role"] != "primary", r["address"]))


async def _from_any(client: RedisCluster, *command: str) -> Any:
    """A cluster-wide command's answer from the first node that gives one: the dashboard matters
    most while a node is down, and a command sent to a random node could pick that one."""
    failure: Exception | None = None
    for node in [*client.get_primaries(), *client.get_replicas()]:
        try:
            return await asyncio.wait_for(client.execute_command(*command, target_nodes=node), NODE_WAIT_S)
        except (RedisError, RedisClusterException, OSError, TimeoutError) as e:
            failure = e
    raise failure or ClusterUnavailable("the cluster client knows no node")


async def _memory(client: RedisCluster, node: ClusterNode) -> dict[str, Any]:
    try:
        found: dict[str, Any] = await asyncio.wait_for(client.info("memory", target_nodes=node), NODE_WAIT_S)
        return found
    except (RedisError, RedisClusterException, OSError, TimeoutError):
        return {}  # a node that does not answer shows no memory, and CLUSTER NODES says why


async def cluster(request: Request) -> Response:
    """GET /v1/admin/cluster: readiness, CLUSTER INFO's state, and every node."""
    svc = _admin(request)
    params.query(request.scope["query_string"], frozenset())
    client = svc.client
    async with svc.reads, metrics.redis_call("admin_cluster"):
        nodes = await _from_any(client, "CLUSTER NODES")
        info = await _from_any(client, "CLUSTER INFO")
        known = client.get_nodes()
        memory = await asyncio.gather(*(_memory(client, node) for node in known))
    per_node = {node.name: found for node, found in zip(known, memory, strict=True)}
    problem = await svc.problem()
    return render(
        request,
        {
            "ready": problem is None,
            "problem": problem,
            "state": info.get("cluster_state"),
            "slots_ok": int(info.get("cluster_slots_ok", 0)),
            "slots_failing": int(info.get("cluster_slots_pfail", 0)) + int(info.get("cluster_slots_fail", 0)),
            "known_nodes": int(info.get("cluster_known_nodes", 0)),
            "primaries": int(info.get("cluster_size", 0)),
            "nodes": node_rows(nodes, per_node),
            "as_of": times.format_ms(times.now_ms()),
        },
    )


async def shards(request: Request) -> Response:
    """GET /v1/admin/boards/{board}/shards: shard -> slot -> primary, and the players each holds."""
    svc = _admin(request)
    query = params.query(request.scope["query_string"], frozenset({"period"}))
    board = await svc.boards.lookup(request.path_params["board"])
    view = board.resolve(query.get("period", "total"))
    period_keys = [keys.period_key(prefix, view.period) for prefix in board.prefixes]
    async with svc.reads, metrics.redis_call("admin_shards"):
        nodes = await _from_any(svc.client, "CLUSTER NODES")
        sizes = await View(svc.client, period_keys, board.scripts.counts).sizes()
    owned = slot_owners(nodes)
    rows = []
    homes, starts = board.config.sharding.shards, board.config.sharding.bands
    banded = board.layout.strategy == "band"
    for shard, (prefix, members) in enumerate(zip(board.prefixes, sizes, strict=True)):
        slot = keys.slot_of(prefix)
        row = {"shard": shard, "slot": slot, "node": owner_of(slot, owned), "members": members}
        # Marked not rebuilt after a loss of Redis (docs/design-notes.md, "A board being rebuilt",
        # "A shard lost alone"): its count is of an emptied shard, and its reads and writes are refused.
        row["rebuilding"] = shard in board.rebuilding
        if banded:  # home shards hold every record; band shards index the total by points
            row["role"] = "home" if shard < homes else "band"
            if shard >= homes:
                row["band_from"] = starts[shard - homes]  # points: the band holds from here up
        rows.append(row)
    body: dict[str, Any] = {"board": board.config.id, "period": view.api, "shards": rows}
    if banded and view.period == "total":
        body["band_skew"] = band_skew(sizes[homes:])
    return render(request, body)


def _summed(
    samples: Iterable[Any], wanted: frozenset[tuple[str, str]], bounds: list[float]
) -> dict[str, Any]:
    """Requests and cumulative latency bucket counts, added up over the (method, route) pairs wanted."""
    counts = [0.0] * (len(bounds) + 1)
    for sample in samples:
        labels = sample.labels
        if not sample.name.endswith("_bucket") or (labels.get("method"), labels.get("route")) not in wanted:
            continue
        le = float(labels["le"])
        counts[bounds.index(le) if le in bounds else len(bounds)] += sample.value
    return {"requests": int(counts[-1]), "buckets": [int(c) for c in counts]}


async def traffic(request: Request) -> Response:
    """GET /v1/admin/metrics: this router's (every worker's) request and score totals so far."""
    _admin(request)
    params.query(request.scope["query_string"], frozenset())
    bounds = list(metrics.LATENCY_BUCKETS)
    latency: list[Any] = []
    scores_done = 0.0
    for family in metrics.registry().collect():
        if family.name == "shardlb_http_request_duration_seconds":
            latency.extend(family.samples)
        elif family.name == "shardlb_scores_applied":
            scores_done += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return render(
        request,
        {
            "at_ms": times.now_ms(),
            "bounds": bounds,
            "writes": {**_summed(latency, WRITES, bounds), "scores": int(scores_done)},
            "reads": _summed(latency, READS, bounds),
        },
    )


RESHARD_FIELDS = frozenset({"shards", "bands", "resume"})
RESHARD_BODY_BYTES = 16 * 1024  # 256 bands at most


async def reshard(request: Request) -> Response:
    """/v1/admin/boards/{board}/reshard: POST starts a reshard ({"shards": N}) or resumes the one
    under way ({"resume": true}) in the background of this router (202 with its status); GET gives
    its state, progress and time left; DELETE cancels one not yet committed (shardlb/reshard.py)."""
    svc = _admin(request)
    params.query(request.scope["query_string"], frozenset())
    board_id = check_id(request.path_params["board"], "board")
    # It seals once every router may know of the reshard: after as long as this one keeps a board
    # (CACHE_SECONDS, as every router; a test's router may keep one for less, tests/test_dashboard.py).
    mover = Resharder(
        svc.boards.store,
        board_id,
        reshards.said(board_id),
        svc.settings.postgres_url or None,
        cache_s=svc.boards.ttl_s,
    )
    if request.method == "GET":
        return render(request, await _status(svc, mover))
    if request.method == "DELETE":
        await mover.cancel()
        return render(request, await _status(svc, mover))
    body = params.integral(await read_object(request, RESHARD_BODY_BYTES))
    for name in body:
        if name not in RESHARD_FIELDS:
            raise unknown_field(name, RESHARD_FIELDS)
    if "resume" in body and (len(body) != 1 or body["resume"] is not True):
        raise InvalidInput('give "shards" (and "bands") or "resume": true, not both', "resume")
    if "shards" not in body and "resume" not in body:
        raise InvalidInput('give "shards" (the new shard count) or "resume": true', "shards", "missing_field")
    if "bands" in body and "shards" not in body:
        raise InvalidInput('"bands" goes with "shards"', "shards", "missing_field")
    if "bands" in body and not isinstance(body["bands"], list):
        raise InvalidInput("bands must be a list of band starts, e.g. [0, 1000, 10000]", "bands")
    if "shards" in body:
        shards, bands = body["shards"], body.get("bands")
        if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
            raise InvalidInput(f"shards must be an integer from 1 to {MAX_SHARDS}", "shards")
        await mover.start(shards, bands)
    # A mover elsewhere holding the board's lease (a `shardlb reshard`, another router's or worker's)
    # is waited for as `shardlb reshard --resume` waits, and what it did said: until 2026-12-06 the
    # 202 came at once, and this router's mover waited in the background, then gave way unsaid.
    # The wait (11 s at most) ends when the router's drain begins (SHARDLB_DRAIN_SECONDS, 10 s by
    # default), with what is known: until 2026-12-06 the drain's end cancelled it (503).
    drains = functools.partial(http.drain_begun, request.scope)
    other = None if svc.reshards.moving(board_id) else await _elsewhere(mover, "shards" in body, drains)
    if other in ("running", "finished", "cancelled"):  # nothing for a mover of this router to do
        status = await _status(svc, mover)
        since = status.get("to_shards") if other != "running" else None  # a reshard recorded since
        note = mover.told_elsewhere(other, status["shards"], since, drains=drains())
        mover.say(note)  # a line of the router's log too (reshards.said)
        return render(request, {**status, "other_mover": other, "note": note}, 202)
    if "shards" not in body and (await mover.status())["state"] == "none":
        raise BoardConflict(f"board {board_id!r} has no reshard under way", "board")
    # Said in Redis before the task exists, so every process's status read after this answer says
    # "starting" (the task's own note may come later), and the task's lease takes it back. For the
    # status alone: one that fails is logged, and the mover started all the same (until 2026-12-06
    # the POST answered 503 with the reshard recorded and no mover started). Not in place of a note
    # said already: a mover that starts says it (this router's between two runs, or another's), and
    # where none of this one starts (the router runs one, or stops) the take-back would remove that
    # one's note (until 2026-12-06: every other process read "none" of a mover about to run).
    await reshards.told(mover.announce(replace=False), board_id)
    if not svc.reshards.start(mover):
        await reshards.told(mover.unannounce(), board_id)  # no task of this mover would take it back
    status = await _status(svc, mover)
    if other == "stopped":
        status = {**status, "other_mover": other, "note": mover.told_elsewhere(other, status["shards"])}
    return render(request, status, 202)


async def _elsewhere(mover: Resharder, recorded: bool, stop: Callable[[], bool]) -> str | None:
    """``Resharder.elsewhere`` for a POST. Redis failing that look once a ``{"shards": N}`` has
    recorded its reshard (``recorded``) is None, logged: the mover is started as before the look
    (it waits for a lease held elsewhere itself, and says so). Until later on 2026-12-06 that was
    a 503 over a reshard recorded with no mover started, which ``reshard`` had ruled out for its
    status note. A resume's look failing is its 503, as before: it recorded nothing."""
    try:
        return await mover.elsewhere(stop)
    except (RedisError, RedisClusterException, OSError) as e:
        if not recorded:
            raise
        fields = {"board": mover.board_id, "error": type(e).__name__}
        said = "reshard recorded, no mover elsewhere looked for: this one starts"
        log.warning(said, extra={"fields": fields})
        return None


async def _status(svc: Service, mover: Resharder) -> dict[str, Any]:
    """The reshard's status (``Resharder.status``): its ``mover`` "starting" where no process holds
    the board's lease but a mover said it starts (``Resharder.announce``: one a POST just started,
    whose task has not taken the lease yet, or one that waits to run again after a failure), read
    alike by every process since 2026-12-06. Said too where this router runs such a mover whose
    note failed or ran out (router/reshards.py). Read after the lease: a mover that ended meanwhile
    is not said to start. Until 2026-12-06 the note was this worker's alone, and the POST's 202
    said "none" before that, as of a reshard nothing moves on."""
    status = await mover.status()
    if status.get("mover") == "none" and svc.reshards.moving(mover.board_id):
        status["mover"] = "starting"
    return status


ROUTES = [
    Route("/v1/admin/cluster", cluster, methods=["GET"]),
    Route("/v1/admin/boards/{board}/reshard", reshard, methods=["GET", "POST", "DELETE"]),
    Route("/v1/admin/boards/{board}/shards", shards, methods=["GET"]),
    Route("/v1/admin/metrics", traffic, methods=["GET"]),
]
