"""Which primaries have a replica to wait for: the one rule every replica-confirmed write follows.

A write confirmed by a replica (``WAIT 1`` after it, on its connection) is waited for on a primary
that has a replica the cluster has not marked failed (``followed``), and made as on a primary
without replicas elsewhere: slot moves (shardlb/slots.py), the reshard mover
(shardlb/reshard_copy.py) and the router's score writes and removals in replica mode
(SHARDLB_ACK=replica, shardlb/fanout.py) all follow it. ``Replicated`` is that rule over the
cluster's topology as one node last said it (CLUSTER NODES), by slot, read again at most every
``TOPOLOGY_S``: never once per write.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from redis.asyncio.cluster import RedisCluster

from shardlb import keys
from shardlb.connection import slot_of
from shardlb.loops import LoopRef

log = logging.getLogger("shardlb.replicas")

TOPOLOGY_S = 1.0  # the topology is read again at most this often (``Replicated``)
AFTER_WAIT_FAILED_S = 0.1  # ... or this often while WAITs go unanswered (``Replicated.refresh``)
# What a slot's byte in ``Replicated.slots`` says of its primary, as last read.
UNKNOWN, FOLLOWED, BARE = 0, 1, 2


def followed(known: Iterable[Mapping[str, Any]]) -> set[str]:
    """The ids of the masters that have a replica the cluster has not marked failed, of every node
    one node knows (CLUSTER NODES as redis-py parses it). A copy onto such a master waits for one
    of its replicas (``WAIT 1``); one onto any other master is made as in a cluster without
    replicas. A replica marked ``fail`` (the masters agreed it has been out of reach for
    cluster-node-timeout) is as good as gone: waiting for it would stop every move until an
    operator forgot it (CLUSTER FORGET), and should it come back it catches up from its primary.
    One merely suspected (``fail?``), or alive but cut off from its primary, still counts: it is the
    replica that lags, and a failover may promote it."""
    return {n["master_id"] for n in known if "slave" in (f := n["flags"].split(",")) and "fail" not in f}


def marks(known: Mapping[str, Mapping[str, Any]]) -> tuple[bytearray, frozenset[str]]:
    """Per slot, whether its master has a replica to wait for (FOLLOWED, ``followed``) or not
    (BARE), UNKNOWN where no master claims it; and the addresses of the masters that serve slots
    with none, of every node one node knows (CLUSTER NODES as redis-py parses it, by address)."""
    waited = followed(known.values())
    slots = bytearray(keys.SLOTS)
    bare = []
    for address, n in known.items():
        if "master" not in n["flags"].split(",") or not n["slots"]:
            continue
        mark = FOLLOWED if n["node_id"] in waited else BARE
        if mark == BARE:
            bare.append(address)
        for first, *rest in n["slots"]:
            last = int(rest[-1]) if rest else int(first)
            slots[int(first) : last + 1] = bytes([mark]) * (last + 1 - int(first))
    return slots, frozenset(bare)


class Replicated:
    """Which slots are served by a primary that has a replica to wait for (``followed``), by CLUSTER
    NODES as the registry's primary last said it.

    The reshard mover reads it in line (``read``: at most once every ``TOPOLOGY_S``) and takes a
    slot it does not know as one without a replica. Replica-confirmed writes never wait for it:
    ``Replicated.of(client)`` is one view per client, read again in the background (``refresh``),
    and a write skips its WAIT only on a slot the view knows is served by a primary without a
    live replica (``bare``); before the first read, and on any slot it does not know, it waits.
    That view says once per change which primaries it writes without a replica (a warning, then
    an info line once one is back: logger ``shardlb.replicas``), and calls ``on_change`` with them.
    """

    def __init__(self, client: RedisCluster, announce: bool = False) -> None:
        self.client = client
        self.slots = bytearray(keys.SLOTS)  # UNKNOWN, FOLLOWED or BARE per slot
        self.read_at = -math.inf
        self.known: dict[str, dict[str, Any]] = {}  # CLUSTER NODES as last read, by address
        self.announce = announce
        self.bare_primaries: frozenset[str] = frozenset()  # addresses, as last read
        self.on_change: Callable[[frozenset[str]], None] | None = None
        self._tried_at = -math.inf
        self._reading: asyncio.Task[None] | None = None
        self._loop = LoopRef()

    @classmethod
    def of(cls, client: RedisCluster) -> Replicated:
        """The view replica-confirmed writes through ``client`` share (one per client)."""
        view = _VIEWS.get(client)
        if view is None:
            view = _VIEWS[client] = cls(client, announce=True)
        return view

    async def read(self, again: bool = False) -> None:
        """Read the topology if it is older than ``TOPOLOGY_S`` (``again``: whatever its age)."""
        if not again and time.monotonic() - self.read_at < TOPOLOGY_S:
            return
        self._tried_at = time.monotonic()
        # Asked of the registry's primary, which every caller needs anyway (a random node may be a
        # replica that does not answer).
        node = self.client.get_node_from_key(keys.BOARDS)
        known: Any = await self.client.execute_command("CLUSTER NODES", target_nodes=node)
        slots, bare = marks(known)
        self.slots, self.known, self.read_at = slots, dict(known), time.monotonic()
        self._changed(bare)

    def refresh(self, soon: bool = False) -> None:
        """Read the topology again in the background when it is older than ``TOPOLOGY_S`` (``soon``:
        a WAIT went unanswered, ``AFTER_WAIT_FAILED_S``): one read at a time, and never more often
        than that, even while the reads fail (the view then stays as it was)."""
        now = time.monotonic()
        if now - self._tried_at < (AFTER_WAIT_FAILED_S if soon else TOPOLOGY_S):
            return
        if self._reading is not None and not self._reading.done():
            return
        self._tried_at = now
        self._reading = self._loop.get().create_task(self._read_quietly())

    async def _read_quietly(self) -> None:
        try:
            await self.read(again=True)
        except Exception as e:  # the cluster is in trouble: writes meet it, and wait as before
            log.debug("topology not read", extra={"fields": {"error": repr(e)}})

    def __call__(self, key: str) -> bool:
        """Whether the primary of ``key`` has a replica to wait for (as last read)."""
        return self.slots[slot_of(key)] == FOLLOWED

    def bare(self, slot: int) -> bool:
        """Whether ``slot``'s primary, as last read, has no replica to wait for (none, or only
        replicas the cluster has marked failed); False for a slot the view does not know."""
        return self.slots[slot] == BARE

    def describe(self, key: str) -> str:
        """The primary of ``key`` and its replicas, as last read: for a message to an operator."""
        slot = slot_of(key)
        for address, n in self.known.items():
            if "master" in n["flags"].split(",") and any(
                int(first) <= slot <= int(rest[-1] if rest else first) for first, *rest in n["slots"]
            ):
                return f"primary {address} (replicas: {', '.join(self._replicas(n)) or 'none'})"
        return f"the primary of slot {slot}"

    def _replicas(self, primary: Mapping[str, Any]) -> list[str]:
        return [
            f"{a} {','.join(f for f in m['flags'].split(',') if f != 'slave') or 'ok'}"
            for a, m in self.known.items()
            if m["master_id"] == primary["node_id"]
        ]

    def _changed(self, bare: frozenset[str]) -> None:
        """Say which primaries went without a live replica, or got one back, since the last read."""
        before, self.bare_primaries = self.bare_primaries, bare
        if bare == before or not self.announce:
            return
        for address in sorted(bare - before):
            replicas = self._replicas(next(n for a, n in self.known.items() if a == address))
            log.warning(
                "primary has no live replica: replica-confirmed writes to it are acknowledged by the "
                "primary alone until one is back",
                extra={"fields": {"primary": address, "replicas": ", ".join(replicas) or "none"}},
            )
        for address in sorted(before - bare):
            # A replica came back or was added, or the primary serves no slot any more.
            log.info(
                "primary is no longer written without a replica: replica-confirmed writes to it wait "
                "for one again",
                extra={"fields": {"primary": address}},
            )
        if self.on_change is not None:
            self.on_change(bare)


_VIEWS: weakref.WeakKeyDictionary[RedisCluster, Replicated] = weakref.WeakKeyDictionary()
