"""Per-node pipelines for reads that touch every shard, without redis-py's cluster-pipeline overhead.

A cross-shard read sends a few sorted-set commands to each shard's key. redis-py's ClusterPipeline
looks every command's keys up in the server's command table, resolves each one's node, wraps the
batch in its retry policy and regroups the replies: for a rank (three commands on each of 16 shards)
that was most of the read's CPU. ``Batch`` records the same commands through redis-py's own command
methods (so arguments and reply parsing are redis-py's), takes the slot from the one key each command
names, the node from the client's slot map, and sends one pipeline per node (what
``ClusterNode.execute_pipeline`` does, which ClusterPipeline ends with, but under one timeout per
pipeline rather than one per reply), all nodes at once.

Any error on that path (a redirect after a slot moved, a closed connection, a full pool) sends the
whole batch again through redis-py's ClusterPipeline, which follows redirects, refreshes the slot map
and applies the client's retry policy. Reads are idempotent, so the fast path never changes an
answer, only what a good one costs; when the cluster is in trouble it costs one extra attempt.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from redis.asyncio.cluster import ClusterNode, PipelineCommand, RedisCluster
from redis.commands.core import SortedSetCommands
from redis.crc import key_slot
from redis.exceptions import ResponseError

_SLOTS: dict[str, int] = {}
_MAX_SLOT_CACHE = 100_000


class Batch(SortedSetCommands):
    """Sorted-set commands on any keys of one cluster, sent per node. Use the redis-py command
    methods (``zcount``, ``zrevrange``...), then ``await execute()`` for the replies in order."""

    def __init__(self, client: RedisCluster) -> None:
        self.client = client
        # One bound for the whole per-node pipeline: the client's socket timeout, as for one reply.
        self.timeout: float | None = client.get_connection_kwargs().get("socket_timeout")
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def execute_command(self, *args: Any, **options: Any) -> Any:
        """Record one command (redis-py's command methods call this); its first key routes it."""
        self.calls.append((args, options))
        return self

    async def execute(self) -> list[Any]:
        """The replies in order: per node when that works, else through redis-py's ClusterPipeline."""
        if not self.calls:
            return []
        replies = await self.direct()
        if replies is None:
            pipe = self.client.pipeline(transaction=False)
            for args, options in self.calls:
                pipe.execute_command(*args, **options)
            replies = list(await pipe.execute())
        return replies

    async def direct(self) -> list[Any] | None:
        """The replies through one pipeline per node, or None when anything did not succeed (the
        caller then retries the whole batch its own way)."""
        try:
            return await self._direct()
        except Exception:
            return None

    async def _direct(self) -> list[Any] | None:
        by_node: dict[str, tuple[ClusterNode, list[PipelineCommand]]] = {}
        commands: list[PipelineCommand] = []
        nodes = self.client.nodes_manager
        for position, (args, options) in enumerate(self.calls):
            key = args[3] if args[0] in ("EVALSHA", "EVAL") else args[1]  # EVALSHA sha 1 key ...
            node = nodes.get_node_from_slot(slot_of(key))
            command = PipelineCommand(position, *args, **options)
            commands.append(command)
            by_node.setdefault(node.name, (node, []))[1].append(command)
        failed = await asyncio.gather(
            *(_pipeline(node, queue, self.timeout) for node, queue in by_node.values()),
            return_exceptions=True,
        )
        if any(f is not False for f in failed):  # True: a command failed; an exception: the node did
            return None
        return [c.result for c in commands]


async def _pipeline(node: ClusterNode, commands: list[PipelineCommand], timeout: float | None) -> bool:
    """Send ``commands`` to ``node`` as one pipeline and parse each reply with redis-py's callbacks.

    What ``ClusterNode.execute_pipeline`` does, with one timeout around the whole pipeline instead of
    one per reply (arming and cancelling a timer for each reply cost more than the read itself).
    Returns True when a command got an error reply. A connection left half-read is closed.
    """
    connection = node.acquire_connection()
    try:
        async with asyncio.timeout(timeout):
            await connection.send_packed_command(connection.pack_commands(c.args for c in commands))
            failed = False
            for c in commands:
                try:
                    reply = await connection.read_response(timeout=math.inf)
                except ResponseError as e:
                    c.result, failed = e, True
                    continue
                parse = node.response_callbacks.get(c.args[0])
                if parse is None:
                    c.result = reply
                else:
                    c.result = parse(reply, **{k: v for k, v in c.kwargs.items() if k != "keys"})
        return failed
    except BaseException:
        await connection.disconnect()
        raise
    finally:
        node.release(connection)


def batch(client: RedisCluster) -> Any:
    """A new Batch, typed loosely: redis-py types its command mixins for its own client classes only."""
    return Batch(client)  # type: ignore[abstract]


def slot_of(key: str) -> int:
    """The cluster slot of ``key`` (hash tag rules included), cached: a board's keys recur."""
    slot = _SLOTS.get(key)
    if slot is None:
        if len(_SLOTS) >= _MAX_SLOT_CACHE:
            _SLOTS.clear()
        slot = _SLOTS[key] = key_slot(key.encode())
    return slot
