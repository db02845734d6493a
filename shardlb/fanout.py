"""Per-node pipelines for reads that touch every shard, without redis-py's cluster-pipeline overhead.

A cross-shard read sends a few sorted-set commands to each shard's key. redis-py's ClusterPipeline
looks every command's keys up in the server's command table, resolves each one's node, wraps the
batch in its retry policy and regroups the replies: for a rank (three commands on each of 16 shards)
that was most of the read's CPU. ``Batch`` records the same commands through redis-py's own command
methods (so arguments and reply parsing are redis-py's), takes the slot from the one key each command
names, the node from the client's slot map, and sends one pipeline per node (what
``ClusterNode.execute_pipeline`` does, which ClusterPipeline ends with, but under one timeout for
the round rather than one per reply), all nodes at once.

``ScriptPipeline`` does the same for the write coalescer's script calls: those made in one turn of
the event loop leave as one pipeline per node.

Acknowledgement (``Ack``, router setting SHARDLB_ACK): in ``replica`` mode each node's pipeline of
write calls ends with a marker write and ``WAIT 1 <timeout>`` on the same connection. WAIT counts
the replicas that have everything *its own connection* wrote, so it has to follow the writes on
their connection (redis-py's cluster client would send it to any node); the marker (a SET, which
always replicates) makes it cover every earlier write to that primary, including what a call that
changes nothing (a retry) found already applied by another connection. A reply below the level
fails every call of that pipeline with NotAcknowledged: applied on the primary, not yet confirmed.
``AckedScript`` makes a single call the same way (the fallback, and ``Board`` without a pipeline).

Any error on that path (a redirect after a slot moved, a closed connection, a full pool) sends the
whole batch again through redis-py's ClusterPipeline, which follows redirects, refreshes the slot map
and applies the client's retry policy. Reads are idempotent, so the fast path never changes an
answer, only what a good one costs; when the cluster is in trouble it costs one extra attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import math
import time
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, Literal, NamedTuple, overload

from redis import exceptions as rx
from redis._parsers import hiredis as _hiredis_parser
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.cluster import PRIMARY
from redis.commands.core import SortedSetCommands

from shardlb import keys
from shardlb.connection import Script, Scripts, read_strategy, script_source, slot_of
from shardlb.errors import NotAcknowledged
from shardlb.loops import LoopRef

SCRIPT_CALLS_IN_FLIGHT = 8
# RESP2 replies straight from the hiredis reader redis-py's connection keeps: its read_response costs
# more per reply than the reply's own parsing (a timeout scope, error checks, push handling).
_HIREDIS_PARSER: type | None = getattr(_hiredis_parser, "_AsyncHiredisParser", None)
_NOT_ENOUGH_DATA: object = getattr(_hiredis_parser, "NOT_ENOUGH_DATA", object())
try:  # hiredis is a dependency (redis[hiredis]); without it redis-py's own packer does the job
    _pack_command: Callable[[Any], bytes] | None = importlib.import_module("hiredis").pack_command
except (ImportError, AttributeError):
    _pack_command = None
_PLAIN = frozenset((str, bytes, int))  # argument types hiredis packs as redis-py would (bool and float: not)
# SHARDLB_ACK: the replicas that must confirm a write before it is answered.
ACK_LEVELS = {"primary": 0, "replica": 1}
MARKER_TTL_MS = 60_000  # the ack marker only has to replicate; it expires when writes stop
# A deletion's marker (``confirmed`` with ``freeing``): sent as EVAL of its source, which Redis
# keeps compiled after the first call, so no NOSCRIPT path is needed for a call this rare.
_FREEING_MARKER = script_source("marker.lua")
ACKED_ATTEMPTS = 3  # an acknowledged call alone: the first try and two after NOSCRIPT or a redirect
# Failures after which the key's primary is looked up again: a slot moved or a node went away.
_MOVED_OR_BROKEN = (
    rx.AskError,
    rx.TryAgainError,
    rx.ClusterDownError,
    rx.ConnectionError,
    rx.TimeoutError,
    OSError,
)
# Of those, the ones after which a call may or may not have run (``AckedScript``'s ``once``).
_BROKEN = (rx.ConnectionError, rx.TimeoutError, OSError)
# Replicas that board reads stopped asking (by node name), until when (time.monotonic()): one whose
# pipeline broke or stalled the round, or that said it is not in sync with its primary
# (``Batch._check_replicas``). Until then their primaries serve their share of the reads.
_SHUNNED: dict[str, float] = {}
SHUN_S = 5.0
# How long a replica may go on serving board reads after its link to its primary went down, and when
# each replica seen out of sync said it went down (time.monotonic()).
STALE_LINK_S = 10.0
_LINK_DOWN_SINCE: dict[str, float] = {}


class Ack(NamedTuple):
    """How a write is confirmed: by ``replicas`` replicas of its primary within ``timeout_ms``
    (0 replicas: by the primary alone, no WAIT)."""

    replicas: int
    timeout_ms: int

    @classmethod
    def of(cls, level: str, timeout_ms: int) -> Ack:
        """The Ack of a SHARDLB_ACK level ("primary" or "replica")."""
        return cls(ACK_LEVELS[level], timeout_ms)


class Command:
    """One command of a round: its arguments, redis-py's options for parsing its reply, its place
    in its batch (-1: one the batch added) and, once read, its reply or the exception it met. What
    redis-py's PipelineCommand holds for the same job, without repacking the arguments (a "my rank"
    makes nine of these)."""

    __slots__ = ("args", "kwargs", "position", "result")

    def __init__(self, position: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
        self.position = position
        self.args = args
        self.kwargs = kwargs if kwargs is not None else {}
        self.result: Any = None


class Batch(SortedSetCommands):
    """Sorted-set commands on any keys of one cluster, sent per node. Use the redis-py command
    methods (``zcount``, ``zrevrange``...), then ``await execute()`` for the replies in order."""

    def __init__(
        self,
        client: RedisCluster,
        ack: Ack | None = None,
        replicas: bool = False,
        shared: bool = False,
        freeing: bool = False,
    ) -> None:
        self.client = client
        # A deletion's confirmation: its marker through marker.lua (allow-oom), which a primary out
        # of memory runs (``confirmed``); every other batch keeps the plain SET.
        self.freeing = freeing
        # A board read's round may share its per-node pipelines with the other reads of its turn
        # of the event loop (``SharedRounds``); a confirmed write's never does (its WAIT would hold
        # the others' replies).
        self.shared = shared and ack is None
        # Board reads may go to a replica of each primary when the client was made for it
        # (connection.connect's read_from): one node per primary for the whole batch.
        self.strategy = read_strategy(client) if replicas and ack is None else None
        # One bound for the whole per-node pipeline: the client's socket timeout, as for one reply
        # (plus the WAIT's own timeout when there is one).
        self.timeout: float | None = client.get_connection_kwargs().get("socket_timeout")
        self.ack = ack if ack is not None and ack.replicas > 0 else None
        if self.ack is not None and self.timeout is not None:
            self.timeout += self.ack.timeout_ms / 1000
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.unscripted: dict[str, ClusterNode] = {}  # replicas that answered NOSCRIPT (``load_scripts``)

    def execute_command(self, *args: Any, **options: Any) -> Any:
        """Record one command (redis-py's command methods call this); its first key routes it."""
        self.calls.append((args, options))
        return self

    def execute(self) -> Coroutine[Any, Any, list[Any]]:
        """The replies in order: per node when that works, else through redis-py's ClusterPipeline."""
        return self._replies(True)

    def direct(self) -> Coroutine[Any, Any, list[Any] | None]:
        """The replies through one pipeline per node, or None when anything did not succeed (the
        caller then retries the whole batch its own way)."""
        return self._replies(False)

    # ``execute`` and ``direct`` hand back this coroutine itself, not one awaiting it: every board
    # read comes here, and each coroutine between a read and its replies is passed again each time
    # the read resumes (bench/README.md, 20ddf50).
    @overload
    async def _replies(self, fallback: Literal[True]) -> list[Any]: ...
    @overload
    async def _replies(self, fallback: Literal[False]) -> list[Any] | None: ...
    async def _replies(self, fallback: bool) -> list[Any] | None:
        if not self.calls:
            return []
        for _ in range(2):
            try:
                replies: list[Any] | None = await self.outcomes()
            except Exception:
                replies = None
            if replies is not None and _no_error(replies):
                return replies
            if self.strategy is None:
                break
            # A replica failed, or lacked a key (it may have left in a slot migration, of which
            # replicas know nothing): the primaries answer instead, following ASK themselves.
            self.strategy = None
        if not fallback:
            return None
        pipe = self.client.pipeline(transaction=False)
        for args, options in self.calls:
            pipe.execute_command(*args, **options)
        return list(await pipe.execute())

    async def outcomes(self) -> list[Any]:
        """Each command's reply, or the exception it met: its own error reply, or the failure of its
        node's whole pipeline (a command there may or may not have run)."""
        by_node: dict[str, tuple[ClusterNode, list[Command], int]] = {}
        commands: list[Command] = []
        nodes = self.client.nodes_manager
        readers: dict[str, ClusterNode] = {}  # primary's name -> the node this batch reads it from
        last_key: Any = None
        queue: list[Command] = []
        for position, (args, options) in enumerate(self.calls):
            key = _key_of(args)
            if key != last_key:  # a read sends a few commands per key in a row: route each key once
                last_key, slot = key, slot_of(key)
                node = nodes.get_node_from_slot(slot)
                if self.strategy is not None:
                    reader = readers.get(node.name)
                    if reader is None:
                        reader = nodes.get_node_from_slot(slot, load_balancing_strategy=self.strategy)
                        if _SHUNNED and reader is not node and _shunned(reader.name):
                            reader = node
                        readers[node.name] = reader
                    node = reader
                entry = by_node.get(node.name)
                if entry is None:
                    entry = by_node[node.name] = (node, [], slot)
                queue = entry[1]
            command = Command(position, args, options)
            commands.append(command)
            queue.append(command)
        on_replicas = (
            {reader.name for primary, reader in readers.items() if reader.name != primary}
            if self.strategy is not None
            else None
        )
        absent, roles = self._check_replicas(by_node, on_replicas) if on_replicas else ([], [])
        ack = self.ack
        if ack is not None:
            freeing = self.freeing
            for _, queue, slot in by_node.values():
                marker = keys.ack_key(slot)
                if freeing:
                    queue.append(Command(-1, ("EVAL", _FREEING_MARKER, 1, marker, 1, MARKER_TTL_MS)))
                else:
                    queue.append(Command(-1, ("SET", marker, 1, "PX", MARKER_TTL_MS)))
                queue.append(Command(-1, ("WAIT", ack.replicas, ack.timeout_ms)))
        sends = [(node, queue) for node, queue, _ in by_node.values()]
        rounds = SharedRounds.of(self.client) if self.shared else None
        if rounds is not None:
            failed = await rounds.round(sends, self.timeout)
        else:
            failed = await _pipelines(sends, self.timeout)
        for (node, queue, _), outcome in zip(by_node.values(), failed, strict=True):
            if isinstance(outcome, BaseException):
                for c in queue:
                    c.result = outcome
                if on_replicas and node.name in on_replicas and _unusable(outcome):
                    _SHUNNED[node.name] = time.monotonic() + SHUN_S
            elif ack is not None:
                _confirm(ack, queue)
            elif (
                on_replicas
                and node.name in on_replicas
                and any(type(c.result) is rx.NoScriptError for c in queue)
            ):
                self.unscripted[node.name] = node
        if ack is None:  # an acknowledged call must get its WAIT where it ran: it is made again
            for c in commands:  # (looked for here: most batches have no ASK, and no coroutine to make)
                if type(c.result) is rx.AskError:
                    await self._follow_asks(commands)
                    break
        for reader, role in roles:
            state = role.result[3] if type(role.result) is list and len(role.result) > 3 else None
            if state in _IN_SYNC:
                if _LINK_DOWN_SINCE:
                    _LINK_DOWN_SINCE.pop(reader.name, None)
            elif not isinstance(role.result, BaseException) and await _out_of_sync_too_long(reader):
                _SHUNNED[reader.name] = time.monotonic() + SHUN_S
                lost = f"replica {reader.name} lost its primary over {STALE_LINK_S:g} s ago"
                return [_ReplicaOutOfSync(lost)]
        for check in absent:
            if check.result == 0:
                return [_KeyNotOnReplica(check.args[1])]
        return [c.result for c in commands]

    def _check_replicas(
        self, by_node: dict[str, tuple[ClusterNode, list[Command], int]], on_replicas: set[str]
    ) -> tuple[list[Command], list[tuple[ClusterNode, Command]]]:
        """Checks at the end of each replica's pipeline: an EXISTS of every key read there, and ROLE.

        A replica keeps no migration state: for a key its primary has already moved to another node
        it answers as if the key did not exist, where the primary would redirect (ASK). A key missing
        there sends the batch to the primaries (``direct``); an empty shard is read from its primary
        too. A replica also keeps serving what it has while its link to its primary is down (cut
        off, resynchronising): without a limit, a read could miss every write since. ROLE says
        whether it is in sync; one whose link has been down over ``STALE_LINK_S`` (by its own
        INFO, asked once per outage) sends the batch to the primaries and is shunned for
        ``SHUN_S``. A shorter outage is served: while a dead primary is being replaced its
        replica is as fresh as any node. Redis notices a silent loss of the link after
        ``repl-timeout`` (60 s by default), a closed one at once."""
        checks: list[Command] = []
        roles: list[tuple[ClusterNode, Command]] = []
        for name, (node, queue, _) in by_node.items():
            if name in on_replicas:
                these = [
                    Command(-1, ("EXISTS", key)) for key in dict.fromkeys(_key_of(c.args) for c in queue)
                ]
                queue.extend(these)
                checks.extend(these)
                role = Command(-1, ("ROLE",))
                queue.append(role)
                roles.append((node, role))
        return checks, roles

    async def load_scripts(self, script: Script) -> None:
        """Load ``script`` on the replicas that answered NOSCRIPT to this batch. A replica started
        again (a killed primary back as its successor's replica) has an empty script cache, and
        SCRIPT LOAD on a primary does not reach it: without this, every read of the script sent there
        would be made again on its primary until the router restarted. One that cannot take it now
        is asked again at its next NOSCRIPT."""
        for node in self.unscripted.values():
            with contextlib.suppress(rx.RedisError, rx.RedisClusterException, OSError):
                await self.client.execute_command("SCRIPT LOAD", script.script, target_nodes=node)
        self.unscripted.clear()

    async def _follow_asks(self, commands: list[Command]) -> None:
        """Send each command answered ASK (its slot is moving and its key has left) to the node named,
        right behind ASKING on the same connection: redis-py 8.1's asyncio client sends ASKING on one
        pooled connection and the command on the next free one, so the target answers MOVED and the
        call ends in "TTL exhausted" (docs/design-notes.md, "Slot migration")."""
        nodes = self.client.nodes_manager
        asked: dict[str, tuple[ClusterNode, list[Command]]] = {}
        for c in commands:
            # MovedError is an AskError too, but it is left to redis-py, which updates its slot map.
            if type(c.result) is rx.AskError:
                target = nodes.get_node(c.result.host, c.result.port)
                if target is None:  # a master added since the slot map was read
                    target = ClusterNode(c.result.host, c.result.port, PRIMARY, **nodes.connection_kwargs)
                    nodes.set_nodes(nodes.nodes_cache, {target.name: target})
                asked.setdefault(target.name, (target, []))[1].append(c)
        if not asked:
            return
        sends = [
            (target, [x for c in queue for x in (Command(-1, ("ASKING",)), c)])
            for target, queue in asked.values()
        ]
        failed = await _pipelines(sends, self.timeout)
        for (_, queue), outcome in zip(sends, failed, strict=True):
            if isinstance(outcome, BaseException):
                for c in queue:
                    c.result = outcome


class _KeyNotOnReplica(Exception):
    """A key a batch read from a replica was not there (``Batch._check_replicas``)."""


class _ReplicaOutOfSync(Exception):
    """A replica a batch read from was not in sync with its primary (``Batch._check_replicas``)."""


class _Stalled(TimeoutError):
    """The node whose replies a round was waiting for when its time ran out (``_pipelines``): the
    others the round had not read yet get the plain TimeoutError."""


_IN_SYNC = ("connected", b"connected")  # ROLE's replication state of a replica in sync


def _shunned(name: str) -> bool:
    """Whether board reads keep away from the replica ``name`` now (``_SHUNNED``)."""
    until = _SHUNNED.get(name)
    if until is None:
        return False
    if time.monotonic() < until:
        return True
    del _SHUNNED[name]
    return False


async def _out_of_sync_too_long(replica: ClusterNode) -> bool:
    """Whether ``replica``'s link to its primary has been down over ``STALE_LINK_S``: asked once
    per outage (INFO's ``master_link_down_since_seconds``; -1 or absent: never in sync), then
    remembered until ROLE says it is back in sync. A replica that cannot say is taken as too long."""
    since = _LINK_DOWN_SINCE.get(replica.name)
    if since is None:
        try:
            info = await replica.execute_command("INFO", "replication")
            down = float(info.get("master_link_down_since_seconds", -1))
        except Exception:
            down = -1.0
        since = _LINK_DOWN_SINCE[replica.name] = time.monotonic() - (down if down >= 0 else math.inf)
    return time.monotonic() - since > STALE_LINK_S


def _unusable(outcome: BaseException) -> bool:
    """Whether a failed pipeline says its node is unusable (broken, refused, or stalled the round),
    not that it was merely not read in time or that the router's own pool was full."""
    if type(outcome) is TimeoutError or isinstance(outcome, rx.MaxConnectionsError):
        return False
    return isinstance(outcome, rx.ConnectionError | rx.TimeoutError | OSError)


def _no_error(replies: list[Any]) -> bool:
    """Whether no reply is an exception: a plain loop, where ``any`` over a generator made and
    resumed a generator for each batch (twice a "my rank")."""
    for reply in replies:  # noqa: SIM110
        if isinstance(reply, Exception):
            return False
    return True


def _key_of(args: Sequence[Any]) -> Any:
    """The one key a recorded command names (EVALSHA sha numkeys key ..., XINFO STREAM key)."""
    if args[0] in ("EVALSHA", "EVAL"):
        return args[3]
    return args[2] if args[0] == "XINFO" else args[1]


def _confirm(ack: Ack, queue: list[Command]) -> None:
    """Fail every call of a node's pipeline that got a reply, unless its marker and WAIT say that
    ``ack.replicas`` replicas have its writes."""
    *calls, marker, wait = queue
    problem: Exception | None = next(
        (c.result for c in (marker, wait) if isinstance(c.result, Exception)), None
    )
    confirmed: Any = wait.result
    if problem is None and int(confirmed) < ack.replicas:
        problem = NotAcknowledged(
            f"{confirmed} of {ack.replicas} replicas confirmed the write within {ack.timeout_ms} ms "
            "(acknowledgement level replica): it is applied on the primary but a failover could still "
            "lose it; retrying is safe"
        )
    if problem is not None:
        for c in calls:
            if not isinstance(c.result, Exception):
                c.result = problem


async def script_calls(
    client: RedisCluster,
    script: Script,
    calls: Sequence[tuple[Any, ...]],
    replicas: bool = False,
    shared: bool = False,
) -> list[Any]:
    """``script`` on several keys, one (key, arguments...) each: through per-node pipelines, or,
    when anything fails there, call by call through ``script`` (which reloads it on NOSCRIPT, on
    the primary). ``replicas``: a read-only script that board reads may send to replicas;
    ``shared``: its round may share pipelines with other reads (``SharedRounds``)."""
    if not calls:
        return []
    pipe = batch(client, replicas=replicas, shared=shared)
    for key, *args in calls:
        pipe.execute_command("EVALSHA", script.sha, 1, key, *args)
    replies: list[Any] | None = await pipe.direct()
    await pipe.load_scripts(script)
    if replies is None:
        gate = asyncio.Semaphore(SCRIPT_CALLS_IN_FLIGHT)  # one read must not take every connection

        async def one(key: str, args: list[Any]) -> Any:
            async with gate:
                return await script(keys=[key], args=args)

        replies = list(await asyncio.gather(*(one(key, args) for key, *args in calls)))
    return replies


class ScriptPipeline:
    """Script calls made in the same turn of the event loop, sent as one pipeline per node.

    ``call`` queues an EVALSHA and returns its reply once the pipeline that carried it is read; the
    first call of a turn schedules the send right after the calls already due in that turn (the
    write coalescer starts every shard's call of a tick in one turn). A call whose command failed
    there is made again on its own through the script object (NOSCRIPT reload, redirects). A write
    script applied twice leaves the state of one call (its statuses then say unchanged or duplicate,
    and a band move the first call left pending is finished by the second: shardlb/bands.py).

    ``merge``: the script's arguments are a list of independent operations (band.lua's moves), so
    the calls of one turn to the same keys travel as ONE call with their arguments one after the
    other, and each caller gets that call's reply. The shards of a band board finish their moves in
    the same turn (their write calls came back in one pipeline), and each sent its own band.lua call
    to every band; merged, each band takes one call a turn, whatever the number of home shards.
    """

    def __init__(self, client: RedisCluster) -> None:
        self.client = client
        self._queued: list[_Queued] = []
        self._merging: dict[tuple[Any, ...], _Queued] = {}
        self._sending: set[asyncio.Task[None]] = set()
        self._loop = LoopRef()

    async def call(self, script: Script, keys: list[str], args: list[Any], merge: bool = False) -> Any:
        """``script``'s reply for ``keys`` and ``args``, through the turn's pipeline or on its own
        (an AckedScript's call is confirmed either way). With ``merge``, the reply of the turn's one
        call to ``keys`` (class docstring); made on its own, the call carries ``args`` only."""
        ack = script.ack if isinstance(script, AckedScript) else None
        try:
            return await self.queue(script.sha, keys, args, ack, merge)
        except NotAcknowledged:
            raise  # applied, and made again alone it would wait as long again
        except Exception:
            return await script(keys=keys, args=args)

    def queue(
        self, sha: str, keys: list[str], args: list[Any], ack: Ack | None = None, merge: bool = False
    ) -> asyncio.Future[Any]:
        """Queue an EVALSHA for the turn's pipeline (confirmed as ``ack`` asks); the future fails with
        whatever it met there."""
        loop = self._loop.get()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._queued:
            loop.call_soon(self._flush)
        if merge:
            same = (sha, ack, *keys)
            queued = self._merging.get(same)
            if queued is not None:
                queued.command.extend(args)
                queued.futures.append(future)
                return future
        queued = _Queued(["EVALSHA", sha, len(keys), *keys, *args], [future], ack)
        self._queued.append(queued)
        if merge:
            self._merging[same] = queued
        return future

    def _flush(self) -> None:
        queued, self._queued = self._queued, []
        self._merging.clear()
        task = self._loop.get().create_task(self._send(queued))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, queued: list[_Queued]) -> None:
        # One batch per acknowledgement level (one in practice: only write.lua comes here).
        levels: dict[Ack | None, list[_Queued]] = {}
        for item in queued:
            levels.setdefault(item.ack, []).append(item)
        queued = [item for items in levels.values() for item in items]
        cancelled = None
        try:
            if len(levels) == 1:  # no task for the one batch of the usual case
                ((ack, items),) = levels.items()
                parts = [await self._outcomes(ack, items)]
            else:
                parts = await asyncio.gather(*(self._outcomes(a, i) for a, i in levels.items()))
            outcomes = [outcome for part in parts for outcome in part]
        except asyncio.CancelledError as e:  # every waiter must hear of it before the task ends
            outcomes, cancelled = [e] * len(queued), e
        except Exception as e:
            outcomes = [e] * len(queued)
        for item, outcome in zip(queued, outcomes, strict=True):
            for future in item.futures:
                if future.done():
                    continue
                if isinstance(outcome, asyncio.CancelledError):
                    future.cancel()
                elif isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)
        if cancelled is not None:
            raise cancelled

    async def _outcomes(self, ack: Ack | None, items: list[_Queued]) -> list[Any]:
        pipe = batch(self.client, ack)
        for item in items:
            pipe.execute_command(*item.command)
        outcomes: list[Any] = await pipe.outcomes()
        return outcomes


class _Queued(NamedTuple):
    command: list[Any]  # EVALSHA, sha, numkeys, keys..., args... (merged calls' args one after another)
    futures: list[asyncio.Future[Any]]  # one per caller
    ack: Ack | None


class AckedScript(Script):
    """A script whose every call with keys is confirmed as ``ack`` asks: the EVALSHA, the marker and
    WAIT go to the key's primary as one pipeline on one connection (``Batch``).

    NOSCRIPT loads the script again on that primary (``Script.reload``); after a redirect or a
    broken connection, a keyed read through the cluster client lets it follow the redirect and
    refresh its slot map under its own retry policy; then the call is made again (a write script
    applied twice leaves the state of one call). Other error replies, and NotAcknowledged, raise.
    ``once``: a call that must not be applied twice (an increment) is made again after a redirect
    or NOSCRIPT only (it did not run); after a broken connection, which may have applied it and
    then lost it with its primary, or not, it raises NotAcknowledged: its caller makes it again
    from a state it knows.
    """

    def __init__(self, client: RedisCluster, script: str, ack: Ack, once: bool = False) -> None:
        super().__init__(client, script)
        self.ack = ack
        self.once = once

    @classmethod
    def of(cls, script: Script, ack: Ack, once: bool = False) -> AckedScript:
        text = script.script
        acked = cls(script.cluster, text if isinstance(text, str) else bytes(text).decode(), ack, once)
        acked.sha = script.sha
        return acked

    async def run(self, numkeys: int, values: list[Any]) -> Any:
        if not numkeys or not self.ack.replicas:
            return await super().run(numkeys, values)
        key = str(values[0])
        reply: Any = None
        for _ in range(ACKED_ATTEMPTS):
            pipe = batch(self.cluster, self.ack)
            pipe.execute_command("EVALSHA", self.sha, numkeys, *values)
            [reply] = await pipe.outcomes()
            if not isinstance(reply, BaseException):
                return reply
            if isinstance(reply, rx.NoScriptError):
                await self.reload(key)
            elif self.once and isinstance(reply, _BROKEN):
                raise NotAcknowledged(
                    "the call's connection broke before a replica confirmed it: it may have been "
                    "applied and lost with its primary, or kept, and it is not one to make twice"
                ) from reply
            elif isinstance(reply, _MOVED_OR_BROKEN):
                await self.cluster.exists(key)
            else:
                raise reply
        raise reply


async def confirmed(
    client: RedisCluster, ack: Ack, commands: Sequence[tuple[Any, ...]], freeing: bool = False
) -> list[Any]:
    """Each command's reply, or the error it met, confirmed as ``ack`` asks: per node one pipeline
    of the commands, the marker and WAIT on one connection (``Batch``), so a reply below the level
    is NotAcknowledged. A command met by a redirect or a broken connection (its slot moved, its
    primary failed over) has the slot map read again, as ``AckedScript`` does, and is made again,
    up to ``ACKED_ATTEMPTS`` times in all: the caller's commands must be safe to make twice.

    ``freeing``: a deletion's confirmation, whose commands a primary out of memory runs (reads),
    its marker then written by marker.lua (allow-oom) rather than a SET, which such a primary
    refuses: a deletion frees memory, and is answered on a full cluster (docs/design-notes.md,
    "Creating and deleting boards on a full cluster"). The marker is one small expiring key."""
    replies: list[Any] = [None] * len(commands)
    todo = list(range(len(commands)))
    for attempt in range(ACKED_ATTEMPTS):
        pipe = batch(client, ack, freeing=freeing)
        for i in todo:
            pipe.execute_command(*commands[i])
        again = []
        for i, reply in zip(todo, await pipe.outcomes(), strict=True):
            replies[i] = reply
            if isinstance(reply, _MOVED_OR_BROKEN):
                again.append(i)
        if not again or attempt == ACKED_ATTEMPTS - 1:
            break
        for key in dict.fromkeys(_key_of(commands[i]) for i in again):
            await client.exists(key)
        todo = again
    return replies


def acknowledged(scripts: Scripts, ack: Ack) -> Scripts:
    """``scripts`` with every write.lua and remove.lua call confirmed as ``ack`` asks (a removal
    answered and then lost in a failover with its journal entry would come back in a rebuild).
    band.lua and settle.lua keep their plain calls: what they write is derived from the home shard
    (router/README.md, "Acknowledgement levels"). remove.lua, an admin's rare call, then leaves
    the router's per-primary script gate (``router/budget.py``): ``moderation.remove`` bounds its
    shards in flight itself."""
    if not ack.replicas:
        return scripts
    return dataclasses.replace(
        scripts, write=AckedScript.of(scripts.write, ack), remove=AckedScript.of(scripts.remove, ack)
    )


async def _pipelines(
    sends: Sequence[tuple[ClusterNode, list[Command]]], timeout: float | None
) -> list[bool | BaseException]:
    """Send each node its ``commands`` as one pipeline, then read the replies node after node and
    parse each with redis-py's callbacks (each command's ``result``). Per node: True when a command
    got an error reply, False when none did, or the exception that failed the node's whole pipeline
    (its connection is then closed: it may be half-read). When the round's time runs out, every
    node not read to the end fails with its TimeoutError, those not sent yet too (their commands
    never left, and have no reply to read).

    What ``ClusterNode.execute_pipeline`` does, for every node at once without a task per node: the
    nodes work on their pipelines together while the replies are read in turn, and one timeout
    bounds the round instead of one per reply and per node (arming a timer for each reply, and a task
    for each node and for each write's own timeout, cost more than the commands themselves).
    """
    if not sends:
        return []
    outcomes: list[bool | BaseException] = [False] * len(sends)
    held: list[tuple[int, ClusterNode, Any]] = []
    unread: set[int] = set()  # pipelines sent (or being sent) and not read to the end
    waiting = -1  # the pipeline being sent or read
    # Whether every pipeline left. Until then a pipeline not in ``unread`` was never sent: when the
    # round's time runs out while one is being sent, those after it fail with it (left at False,
    # they read as answered, their commands' results still None: a write's reply of None).
    sent = False
    try:
        for i, (node, _) in enumerate(sends):
            try:
                held.append((i, node, node.acquire_connection()))
            except Exception as e:  # the node's pool is full
                outcomes[i] = e
        with _Deadline(timeout, _loop_of(held)):
            for i, _, connection in held:
                unread.add(i)
                waiting = i
                try:
                    await _send(connection, _packed(connection, sends[i][1]))
                except Exception as e:
                    outcomes[i] = e
            sent = True
            for i, node, connection in held:
                if isinstance(outcomes[i], BaseException):
                    continue
                waiting = i
                try:
                    outcomes[i] = await _replies(node, connection, sends[i][1])
                    unread.discard(i)
                except Exception as e:
                    outcomes[i] = e
    except TimeoutError as e:
        for i, _, _ in held:
            if (i in unread or not sent) and not isinstance(outcomes[i], BaseException):
                outcomes[i] = e
        if waiting in unread and outcomes[waiting] is e:
            stalled = _Stalled(f"no reply from {sends[waiting][0].name} in time")
            stalled.__cause__ = e
            outcomes[waiting] = stalled
    finally:
        closed: dict[str, ClusterNode] = {}
        for i, node, connection in held:
            if i in unread:
                # Aborted, not closed: a node that reads nothing (busy, frozen, cut off) keeps a
                # large pipeline's unsent bytes from draining, and waiting for them to, past the
                # connect timeout, raised here and kept this connection (and the next) out of the pool.
                writer = getattr(connection, "_writer", None)
                if writer is not None:
                    writer.transport.abort()
                with contextlib.suppress(Exception):
                    await connection.disconnect(nowait=True)
                if _closed_under_us(outcomes[i]):
                    closed[node.name] = node
            node.release(connection)
        for node in closed.values():
            # The server closed this connection (a restart, a failover, CLIENT KILL): it closed the
            # node's idle ones too. Drop those now and have the busy ones reconnect when released,
            # as redis-py does after a ConnectionError, or each would fail one later round in turn.
            node.update_active_connections_for_reconnect()
            await node.disconnect_free_connections()
    return outcomes


def _closed_under_us(outcome: bool | BaseException) -> bool:
    """Whether a pipeline failed because its connection broke, not because the node was slow (a
    timeout leaves the node's other connections alone: reconnecting them would only add load)."""
    if isinstance(outcome, TimeoutError | rx.TimeoutError):
        return False
    return isinstance(outcome, rx.ConnectionError | OSError)


class _Deadline:
    """``asyncio.timeout`` for one round, on the loop of the round's connections.

    CPython 3.11 checks ``getpid()`` in every ``get_running_loop`` (to notice a loop inherited
    across a fork), a real system call that costs several microseconds on a VM, and
    ``asyncio.timeout`` makes three (entering, arming, the current task): a rank's two rounds
    made twelve, more than the rank's other system calls together. A connected redis-py connection
    already knows its loop (its streams were made on it, and it cannot serve another). Same rules
    as ``asyncio.Timeout``: when the timer cancels the task, leaving the block turns that
    cancellation into TimeoutError, unless someone else cancelled the task too.
    """

    __slots__ = ("_cancelling", "_fired", "_handle", "_task")

    def __init__(self, seconds: float | None, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._handle: asyncio.TimerHandle | None = None
        self._fired = False
        self._cancelling = 0
        if seconds is not None:
            loop = loop or asyncio.get_running_loop()
            task = asyncio.current_task(loop)
            assert task is not None, "a round runs inside a task"
            self._task = task
            self._cancelling = task.cancelling()
            self._handle = loop.call_later(seconds, self._fire)

    def _fire(self) -> None:
        self._fired = True
        self._task.cancel()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self._handle is not None:
            self._handle.cancel()
        if self._fired and self._task.uncancel() <= self._cancelling and kind is asyncio.CancelledError:
            raise TimeoutError from exc


def _loop_of(held: Sequence[tuple[int, ClusterNode, Any]]) -> asyncio.AbstractEventLoop | None:
    """The event loop of the first connected connection's stream (``_Deadline``), if any."""
    for _, _, connection in held:
        loop = getattr(getattr(connection, "_reader", None), "_loop", None)
        if loop is not None:
            return loop  # type: ignore[no-any-return]
    return None


async def _send(connection: Any, packed: bytes | list[bytes]) -> None:
    """Write a packed pipeline. On an open connection straight to its stream (redis-py's own send
    wraps each write in a task of its own for the socket timeout, which the caller's round already
    bounds); else through redis-py, which connects first."""
    if connection.is_connected and hasattr(connection, "_send_packed_command"):
        try:
            await connection._send_packed_command([packed] if isinstance(packed, bytes) else packed)
        except OSError as e:
            raise rx.ConnectionError(f"error writing to {connection.host}:{connection.port}: {e}") from e
    else:
        await connection.send_packed_command(packed, check_health=False)


async def _replies(node: ClusterNode, connection: Any, commands: list[Command]) -> bool:
    """Read one reply per command into its ``result``; True when one was an error reply."""
    failed = False
    callbacks = node.response_callbacks
    parser = getattr(connection, "_parser", None)
    reader = getattr(parser, "_reader", None) if type(parser) is _HIREDIS_PARSER else None
    if reader is None:
        replies = _read_each(connection, len(commands))  # another parser: redis-py's own reads
    for c in commands:
        reply = await anext(replies) if reader is None else await _reply(connection, parser, reader)
        if isinstance(reply, rx.ResponseError):
            c.result, failed = reply, True
            continue
        if (
            c.kwargs.get("withscores")
            and type(reply) is list
            and reply
            and type(reply[0]) is list
            and c.kwargs.get("score_cast_func", float) is float
        ):
            # RESP3 (member, score) pairs, each score a double already: redis-py's legacy callback
            # would format every score to text and parse it back (most of a page's client CPU).
            c.result = [(member, score) for member, score in reply]
            continue
        parse = callbacks.get(c.args[0])
        if parse is None:
            c.result = reply
        elif c.kwargs:
            c.result = parse(reply, **{k: v for k, v in c.kwargs.items() if k != "keys"})
        else:
            c.result = parse(reply)
    return failed


async def _reply(connection: Any, parser: Any, reader: Any) -> Any:
    """The next reply from the connection's hiredis reader, reading the socket as needed; a RESP3
    push message (none is asked for on these connections) is handed to redis-py and skipped."""
    while True:
        reply = reader.gets()
        while reply is _NOT_ENOUGH_DATA:
            try:
                await parser.read_from_socket()
            except OSError as e:
                raise rx.ConnectionError(
                    f"error reading from {connection.host}:{connection.port}: {e}"
                ) from e
            reply = reader.gets()
        if isinstance(reply, rx.ConnectionError):
            raise reply
        push = parser._hiredis_PushNotificationType
        if push is None or not isinstance(reply, push):
            return reply
        await parser.handle_push_response(reply)


async def _read_each(connection: Any, count: int) -> AsyncIterator[Any]:
    """``count`` replies through redis-py's read_response, an error reply as its exception."""
    for _ in range(count):
        try:
            yield await connection.read_response(timeout=math.inf)
        except rx.ResponseError as e:
            yield e


def _packed(connection: Any, commands: list[Command]) -> bytes | list[bytes]:
    """The commands in RESP, packed by hiredis (in C) when every argument is a str, bytes or int,
    as a board read's and a write script call's are; else by redis-py's own (Python) packer."""
    if _pack_command is not None and all(
        _PLAIN.issuperset(map(type, c.args)) and not (type(c.args[0]) is str and " " in c.args[0])
        for c in commands
    ):
        return b"".join([_pack_command(c.args) for c in commands])
    packed: list[bytes] = connection.pack_commands(c.args for c in commands)
    return packed


def batch(
    client: RedisCluster,
    ack: Ack | None = None,
    replicas: bool = False,
    shared: bool = False,
    freeing: bool = False,
) -> Any:
    """A new Batch, typed loosely: redis-py types its command mixins for its own client classes only.
    ``replicas``: a board read, which may be served by replicas; ``shared``: a board read, whose
    round may travel with the other reads of its turn of the event loop; ``freeing``: a deletion's
    confirmation (``confirmed``)."""
    return Batch(client, ack, replicas, shared, freeing)  # type: ignore[abstract]


_Sends = Sequence[tuple[ClusterNode, list[Command]]]
_Outcomes = list[bool | BaseException]


class SharedRounds:
    """The rounds of board reads started in one turn of the event loop, sent as one pipeline per
    node.

    Concurrent requests wake in the same turn (every socket that became readable), and each starts
    its read's round there: 32 connections asking for ranks made up to one pipeline per read in
    flight (16 under the router's read gate) to each node in one turn, each costing a write and a
    read system call in the router and as much again in Redis, more than the few commands in it.

    A round joins the turn's shared one: the first schedules a task that sends, once the turn is
    over, every waiting round's commands to each node as one pipeline (``_pipelines``), and each
    round gets its own commands' replies (in their ``result``) and, per node, the failure of that
    node's pipeline if it failed. The replies are those of the same commands sent alone: only the
    packaging changes. Writes never come here.

    A command that another round of the turn also sends to the same node, with the same arguments,
    and whose reply is one number (``ONE_REPLY``: every "my rank" asks each shard's ZCARD) is sent
    once, and its reply is given to each. That reply is one the command could have had sent alone:
    it ran after every round that shares it had joined (the pipeline leaves once the turn is over),
    and before any of them got an answer.
    """

    __slots__ = ("_loop", "_running", "_waiting")

    def __init__(self) -> None:
        self._waiting: list[tuple[_Sends, float | None, asyncio.Future[_Outcomes]]] = []
        self._running: set[asyncio.Task[None]] = set()
        self._loop = LoopRef()

    @classmethod
    def of(cls, client: RedisCluster) -> SharedRounds | None:
        """The shared rounds of ``client``'s reads; None when ``share_reads`` turned them off."""
        try:
            return _SHARED_ROUNDS[client]
        except KeyError:
            rounds = _SHARED_ROUNDS[client] = cls()
            return rounds

    def round(self, sends: _Sends, timeout: float | None) -> asyncio.Future[_Outcomes]:
        """Per entry of ``sends``: False once its commands have their replies, or the exception
        that failed that node's pipeline (as ``_pipelines`` answers)."""
        loop = self._loop.get()
        future: asyncio.Future[_Outcomes] = loop.create_future()
        if not self._waiting:
            task = loop.create_task(self._send())
            self._running.add(task)
            task.add_done_callback(self._running.discard)
        self._waiting.append((sends, timeout, future))
        return future

    async def _send(self) -> None:
        waiting, self._waiting = self._waiting, []
        merged: dict[str, tuple[ClusterNode, list[Command]]] = {}
        where: list[list[str]] = []
        sent: dict[tuple[str, tuple[Any, ...]], Command] = {}  # (node, args) -> the one sent
        copies: list[tuple[Command, Command]] = []  # (a command not sent, the one whose reply it takes)
        for sends, _, _ in waiting:
            names = []
            for node, queue in sends:
                name = node.name
                names.append(name)
                entry = merged.get(name)
                if entry is None:
                    entry = merged[name] = (node, [])
                if len(waiting) == 1:
                    entry[1].extend(queue)
                    continue
                kept = entry[1]
                for c in queue:
                    args, kwargs = c.args, c.kwargs
                    # One of ONE_REPLY with nothing but its key beside it (redis-py passes ``keys``
                    # for routing; any other option could change how its reply is parsed).
                    if args[0] in ONE_REPLY and (not kwargs or (len(kwargs) == 1 and "keys" in kwargs)):
                        try:
                            first = sent.setdefault((name, args), c)
                        except TypeError:  # an argument that cannot be a dict key: sent as it is
                            first = c
                        if first is not c:
                            copies.append((c, first))
                            continue
                    kept.append(c)
            where.append(names)
        bounds = [bound for _, bound, _ in waiting]
        timeout = None if None in bounds else max(bounds)  # type: ignore[type-var]
        try:
            failed = await _pipelines(list(merged.values()), timeout)
        except asyncio.CancelledError:  # the loop is closing: every reader hears of it
            for _, _, future in waiting:
                future.cancel()
            raise
        except Exception as e:  # not a node's failure (those are outcomes): each reader gets it
            for _, _, future in waiting:
                if not future.done():
                    future.set_exception(e)
            return
        for c, first in copies:
            c.result = first.result
        # Per node: its failure, or False (the replies themselves are in the commands).
        outcome = {
            name: f if isinstance(f, BaseException) else False for name, f in zip(merged, failed, strict=True)
        }
        for (_, _, future), names in zip(waiting, where, strict=True):
            if not future.done():
                future.set_result([outcome[name] for name in names])


# Read commands whose reply is one number (or nil): one such command of a shared round serves every
# round of the turn that sends the same to the same node (``SharedRounds``). A list reply is never
# shared: its readers could change it.
ONE_REPLY = frozenset({"ZCARD", "ZCOUNT", "ZSCORE", "ZREVRANK", "ZRANK", "ZLEXCOUNT", "EXISTS"})


_SHARED_ROUNDS: weakref.WeakKeyDictionary[RedisCluster, SharedRounds | None] = weakref.WeakKeyDictionary()


def share_reads(client: RedisCluster, on: bool) -> None:
    """Whether ``client``'s board reads share their rounds (the default) or each send their own
    (the router's SHARDLB_SHARED_READS)."""
    _SHARED_ROUNDS[client] = SharedRounds() if on else None
