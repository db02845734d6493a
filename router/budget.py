"""The connection budget: every path that takes a connection to a cluster primary, and its bound.

redis-py keeps at most ``max_connections`` connections per node and raises MaxConnectionsError at
once when a call needs one more (its cluster pipelines then close and reopen the whole client,
failing every other call in flight). So the router bounds each path in front of redis-py, and the
bounds add up to at most the pool cap per primary:

    NODE_CONCURRENCY            write.lua calls of the coalescer (a permit per call, per primary)
  + SCRIPT_CONCURRENCY          every other script call: band moves, histogram samples, counts.lua
                                when a read's pipeline failed and it is retried call by call
  + READ_PIPELINES * READ_CONCURRENCY
                                reads in flight; a read runs at most two pipelines at once
                                (``Board.player``: counts and sizes), one connection per primary each
  + LANES                       one top-cache refresh, one readiness probe, two board-registry calls
  + RESERVE                     left free for transients (see README)
  <= SHARDLB_REDIS_MAX_CONNECTIONS

``Settings.check`` refuses settings that break the sum; router/README.md has the reasoning. The
journal watcher (router/journals.py) has a client of its own, two connections a node, outside it.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio.cluster import RedisCluster

from router.gate import NodeGates
from shardlb.connection import Script, primary_name

READ_PIPELINES = 2
REFRESH_LANES = 1
READY_LANES = 1
REGISTRY_LANES = 2
LANES = REFRESH_LANES + READY_LANES + REGISTRY_LANES
RESERVE = 4


def connections_needed(node_concurrency: int, script_concurrency: int, read_concurrency: int) -> int:
    """The most connections per primary that the router's bounds allow at once, reserve included."""
    return node_concurrency + script_concurrency + READ_PIPELINES * read_concurrency + LANES + RESERVE


class BoundedScript(Script):
    """A Lua script whose every call holds a permit of its primary's gate (when ``gates`` is set; the
    coalescer bounds write.lua itself). Its NOSCRIPT reload (``Script``) runs under the same permit."""

    def __init__(self, client: RedisCluster, script: str, gates: NodeGates | None) -> None:
        super().__init__(client, script)
        self.gates = gates

    @classmethod
    def of(cls, script: Script, client: RedisCluster, gates: NodeGates | None) -> BoundedScript:
        text = script.script
        bounded = cls(client, text if isinstance(text, str) else bytes(text).decode(), gates)
        bounded.sha = script.sha
        return bounded

    async def run(self, numkeys: int, values: list[Any]) -> Any:
        if self.gates is None or not numkeys:
            return await super().run(numkeys, values)
        async with self.gates(primary_name(self.cluster, str(values[0]))):
            return await super().run(numkeys, values)
