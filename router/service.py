"""What one worker runs: its cluster client, board store, write coalescer, caches and limits.

``Service.start`` connects, loads every Lua script on every primary (retrying until the cluster
answers or SHARDLB_STARTUP_TIMEOUT_S passes) and starts the cache refresh tasks; only then does the
worker take requests. ``Service.stop`` refuses new writes, drains the coalescer, writes the refused
results still queued for PostgreSQL and lets the webhook delivery tasks give back what they hold
within SHARDLB_DRAIN_SECONDS, and closes the client.

Every path to the cluster goes through one of the gates made here; router/budget.py adds up what
they allow per primary, which the settings check keeps within the client's connection cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from redis import exceptions as rx
from redis.asyncio.cluster import RedisCluster

from router import metrics
from router.auth import Keys
from router.boards import Boards
from router.budget import REGISTRY_LANES, BoundedScript
from router.cache import Rendered, TopCache
from router.coalescer import Coalescer
from router.gate import Gate, NodeGates
from router.histogram import Histograms
from router.journals import JournalWatch
from router.limiter import ReadLimits
from router.media import entry_body
from router.moderation import BanCache, Moderation, RefusalLog
from router.reshards import ReshardWatch
from router.settings import Settings
from shardlb.board import Board
from shardlb.connection import Scripts, connect, redacted
from shardlb.errors import ClusterUnavailable
from shardlb.fanout import Ack, ScriptPipeline, acknowledged, share_reads
from shardlb.keys import SLOTS
from shardlb.moderation import Bans
from shardlb.outage import Outage
from shardlb.reads import ResolvedView
from shardlb.store import BoardStore

log = logging.getLogger("shardlb.router")
READY_TIMEOUT_S = 2.0
STARTUP_RETRY_S = 0.5  # the pause between tries to reach the cluster at start


# PostgreSQL connections a worker's public reads of the archive may hold at once (``archive_reads``).
ARCHIVE_READ_LANES = 4
# ... and its write key's calls (a settlement, its awards, their acknowledgement: ``archive_calls``).
ARCHIVE_CALL_LANES = 4


@dataclass
class Service:
    settings: Settings
    client: RedisCluster
    boards: Boards
    keys: Keys
    limiter: ReadLimits
    reads: Gate
    scripts: NodeGates
    coalescer: Coalescer
    tops: TopCache
    histograms: Histograms
    journals: JournalWatch
    moderation: Moderation
    reshards: ReshardWatch
    # PostgreSQL connections that public reads (settled periods, player histories) may hold at once
    # in this worker: each opens one, so callers without a key must not open one each.
    archive_reads: Gate = field(default_factory=lambda: Gate(ARCHIVE_READ_LANES, what="archive reads"))
    # The same for the settlement calls of a write key (router/settlements.py): a connection each,
    # and as many at once as the worker took requests (SHARDLB_MAX_REQUESTS) until 2026-12-05.
    archive_calls: Gate = field(default_factory=lambda: Gate(ARCHIVE_CALL_LANES, what="archive calls"))
    # Archive reads in progress or waiting, by client without a key (router/history.py).
    archive_readers: dict[str, int] = field(default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # Settlement id -> the task sending its webhook deliveries (router/settlements.py): one each.
    deliveries: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    # Every delivery task not ended yet, those a new request replaced (cancelled, giving back the
    # rows they claimed) included: ``stop`` waits for them all.
    delivering: set[asyncio.Task[None]] = field(default_factory=set)
    draining: bool = False
    recording: asyncio.Task[None] | None = None  # the refusal log's task, also in ``tasks``
    _probe: asyncio.Future[str | None] | None = None

    @classmethod
    async def start(cls, settings: Settings) -> Service:
        """Connect and load scripts (retrying up to the start-up timeout), then start the refreshers."""
        client = connect(
            settings.redis_url,
            settings.redis_max_connections,
            settings.redis_timeout_s,
            password=settings.redis_password,
            read_from=settings.read_from,
        )
        share_reads(client, settings.shared_reads)
        # A call already under way waits for a script permit as long as for a reply; new requests
        # wait for the read gate or the registry only SHARDLB_QUEUE_WAIT_S.
        script_gates = NodeGates(settings.script_concurrency, settings.redis_timeout_s, "script calls")
        ack = Ack.of(settings.ack, settings.ack_timeout_ms)
        scripts = acknowledged(_bounded(Scripts.register(client), client, script_gates), ack)
        histograms = Histograms(
            client,
            script_gates,
            settings.histogram_samples,
            settings.histogram_refresh_s,
            max_samples=settings.histogram_cache_samples,
        )
        deadline = time.monotonic() + settings.startup_timeout_s
        # Logged as the background tasks' outages are: the start may wait up to an hour.
        outage = Outage(log, "cluster not reachable yet; retrying", "cluster reached")
        while True:
            try:
                await scripts.load(client)
                await histograms.load_script(client)
                break
            except (rx.RedisError, rx.RedisClusterException, OSError) as e:
                if time.monotonic() >= deadline:
                    await client.aclose()
                    raise ClusterUnavailable(f"no cluster at {redacted(settings.redis_url)}: {e}") from e
                outage.failed(e)
                await asyncio.sleep(STARTUP_RETRY_S)
            except asyncio.CancelledError:  # stopped while it waits (router/app.py)
                await client.aclose()
                raise
        outage.succeeded()
        store = BoardStore(client, scripts, settings.journal_max_entries, settings.journal_max_results)
        store.read_replicas = settings.read_from != "primary"
        store.ack = ack
        finished = await store.reclaim()  # deletions some process left half done
        if finished:
            log.warning("finished interrupted board deletions", extra={"fields": {"boards": finished}})
        reads = Gate(settings.read_concurrency, settings.read_queue, settings.queue_wait_s, "reads")
        registry = Gate(REGISTRY_LANES, settings.read_queue, settings.queue_wait_s, "board lookups")
        archive_reads = Gate(ARCHIVE_READ_LANES, settings.read_queue, settings.queue_wait_s, "archive reads")
        archive_calls = Gate(ARCHIVE_CALL_LANES, settings.read_queue, settings.queue_wait_s, "archive calls")

        bans = BanCache(Bans(client, ack))
        await bans.refresh()  # before the first request: a ban in force is never missed at start

        async def fetch_top(board: Board, view: ResolvedView, limit: int) -> Rendered:
            async with metrics.redis_call("top"):
                found = await board.top(limit, view, "unique")  # a read asking competition re-ranks
            return [entry_body(e) for e in found]

        boards = Boards(store, registry)
        histograms.boards = boards
        service = cls(
            settings=settings,
            client=client,
            boards=boards,
            keys=Keys(settings),
            limiter=ReadLimits.of(settings),
            reads=reads,
            scripts=script_gates,
            coalescer=Coalescer(
                settings.coalesce_delay_ms / 1000,
                settings.coalesce_max_batch,
                settings.queue_limit,
                settings.node_concurrency,
                wait_s=settings.redis_timeout_s,
                pipeline=ScriptPipeline(client),
                inflight=settings.coalesce_inflight,
            ),
            tops=TopCache(
                fetch_top,
                settings.top_refresh_s,
                settings.top_idle_s,
                live=reads,
                max_rows=settings.top_cache_rows,
                boards=boards,
            ),
            histograms=histograms,
            # Journal entries carry MessagePack: the watcher reads them through its own small client.
            journals=JournalWatch(
                connect(settings.redis_url, 2, settings.redis_timeout_s, False, settings.redis_password),
                store,
                settings.journal_max_entries,
                settings.journal_max_results,
            ),
            moderation=Moderation(bans, RefusalLog(settings.postgres_url)),
            reshards=ReshardWatch(store, registry, settings.postgres_url),
            archive_reads=archive_reads,
            archive_calls=archive_calls,
        )
        # The registry's version before the first request (else taken in at the first look).
        with contextlib.suppress(rx.RedisError, rx.RedisClusterException, OSError):
            await service.boards.follow()
        service.recording = asyncio.create_task(service.moderation.refusals.run())
        service.tasks = [
            asyncio.create_task(service.tops.run()),
            asyncio.create_task(histograms.run()),
            asyncio.create_task(service.journals.run()),
            asyncio.create_task(bans.run()),
            asyncio.create_task(service.reshards.run()),
            asyncio.create_task(service.boards.run()),
            service.recording,
        ]
        return service

    async def stop(self) -> None:
        """Refuse writes, apply what was accepted, record the refused results queued and end the
        webhook deliveries (all bounded by SHARDLB_DRAIN_SECONDS), then disconnect."""
        self.draining = True
        ends = time.monotonic() + self.settings.drain_seconds
        # Webhook deliveries stop too, while the coalescer drains: each gives back the rows it holds,
        # due at once, and an archiver's sweep (or the settlement run again) sends them
        # (shardlb/settlement_delivery.py). A replaced task was cancelled when it was replaced and is
        # giving its rows back already: cancelled again, it would stop half way.
        for task in self.deliveries.values():
            task.cancel()
        left = await self.coalescer.close(self.settings.drain_seconds)
        self.journals.closed = self.moderation.bans.closed = self.reshards.closed = self.boards.closed = True
        # The refused results answered before the stop are written first (cut off at the drain's
        # end, as a delivery is): cancelled at once, the rows it held were lost.
        refusals = self.moderation.refusals
        refusals.close()
        if self.recording is not None:
            await asyncio.wait({self.recording}, timeout=max(ends - time.monotonic(), 0.0))
        if refusals.rows:
            fields = {"refused_results": len(refusals.rows)}
            log.warning("refused results not recorded at the drain's end", extra={"fields": fields})
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.reshards.stop()  # before the client closes: its movers use it
        await self._deliveries_ended(ends - time.monotonic())
        await self.client.aclose()
        await self.journals.raw.aclose()
        fields = {"scores_not_applied": left.not_applied, "scores_in_doubt": left.in_doubt}
        log.info("router stopped", extra={"fields": fields})

    async def _deliveries_ended(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for every delivery task to end (to give back what it holds); one
        still running then is cut off, and its rows wait out their lease (as a killed worker's)."""
        if not self.delivering:
            return
        _, late = await asyncio.wait(self.delivering, timeout=max(timeout, 0.0))
        if late:
            fields = {"tasks": len(late)}
            log.warning("webhook deliveries cut off at the drain's end", extra={"fields": fields})
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    async def problem(self) -> str | None:
        """Why this worker should not get traffic now (None when ready): draining, cluster down or
        unreachable, or slots not all served, as each primary's CLUSTER INFO says. Probes arriving
        while one is under way share its answer: one CLUSTER INFO per primary at a time."""
        if self.draining:
            return "the router is shutting down"
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._cluster_problem())
        return await asyncio.shield(self._probe)

    async def _cluster_problem(self) -> str | None:
        try:
            async with metrics.redis_call("cluster_info"):
                infos: Any = await asyncio.wait_for(
                    self.client.cluster_info(target_nodes=self.client.get_primaries()), READY_TIMEOUT_S
                )
        except (rx.RedisError, rx.RedisClusterException, OSError, TimeoutError) as e:
            return f"the cluster is not reachable ({type(e).__name__})"
        # One node's reply is the info itself; several come as {node name: info}.
        replies: list[dict[str, str]] = [infos] if "cluster_state" in infos else list(infos.values())
        for info in replies:
            if info.get("cluster_state") != "ok":
                return f"cluster_state is {info.get('cluster_state')}"
            if int(info.get("cluster_slots_ok", 0)) != SLOTS:
                return f"only {info.get('cluster_slots_ok')} of {SLOTS} slots are served"
        return None


def _bounded(scripts: Scripts, client: RedisCluster, gates: NodeGates) -> Scripts:
    """The library's scripts, each call under its primary's script gate; write.lua is bounded by
    the coalescer's own gates (it is only called from there), so it only gets the one-node reload."""
    return dataclasses.replace(
        scripts,
        **{
            f.name: BoundedScript.of(getattr(scripts, f.name), client, None if f.name == "write" else gates)
            for f in dataclasses.fields(scripts)
        },
    )
