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

``Settings.check`` refuses settings that break the sum; router/README.md has the reasoning.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError
from redis.typing import EncodableT, KeyT

from router.gate import NodeGates

READ_PIPELINES = 2
REFRESH_LANES = 1
READY_LANES = 1
REGISTRY_LANES = 2
LANES = REFRESH_LANES + READY_LANES + REGISTRY_LANES
RESERVE = 4


def connections_needed(node_concurrency: int, script_concurrency: int, read_concurrency: int) -> int:
    """The most connections per primary that the router's bounds allow at once, reserve included."""
    return node_concurrency + script_concurrency + READ_PIPELINES * read_concurrency + LANES + RESERVE


def node_name(client: RedisCluster, key: str) -> str:
    """The name of the primary serving ``key`` in the client's slot map ("unknown" while it is
    being refreshed: those calls then share one bound)."""
    try:
        node = client.nodes_manager.get_node_from_slot(client.keyslot(key))
    except Exception:
        return "unknown"
    return str(node.name)


class BoundedScript(AsyncScript):
    """A Lua script whose every call holds a permit of its primary's gate (when ``gates`` is set; the
    coalescer bounds write.lua itself). On NOSCRIPT (a promoted replica starts with an empty script
    cache) the script is loaded on that primary only, under the same permit, so a reload takes one
    connection, not one on every primary as ``AsyncScript`` does."""

    def __init__(self, client: RedisCluster, script: str, gates: NodeGates | None) -> None:
        super().__init__(client, script)
        self.cluster = client
        self.gates = gates

    @classmethod
    def of(cls, script: AsyncScript, client: RedisCluster, gates: NodeGates | None) -> BoundedScript:
        text = script.script
        bounded = cls(client, text if isinstance(text, str) else bytes(text).decode(), gates)
        bounded.sha = script.sha
        return bounded

    async def __call__(
        self,
        keys: Sequence[KeyT] | None = None,
        args: Iterable[EncodableT] | None = None,
        client: Any = None,
    ) -> Any:
        names = list(keys or [])
        values = [*names, *(args or [])]
        if self.gates is None or not names:
            return await self._run(len(names), values)
        async with self.gates(node_name(self.cluster, str(names[0]))):
            return await self._run(len(names), values)

    async def _run(self, numkeys: int, values: list[Any]) -> Any:
        try:
            return await self.cluster.evalsha(self.sha, numkeys, *values)
        except NoScriptError:
            node = self.cluster.get_node_from_key(str(values[0])) if numkeys else None
            if node is None:
                self.sha = await self.cluster.script_load(self.script)
            else:
                self.sha = await self.cluster.execute_command("SCRIPT LOAD", self.script, target_nodes=node)
            return await self.cluster.evalsha(self.sha, numkeys, *values)
