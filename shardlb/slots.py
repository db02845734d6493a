"""Moving hash slots between the masters of a running cluster, and where each board's shards are.

A slot moves the way Redis Cluster's specification (and ``redis-cli --cluster``) moves it:
``CLUSTER SETSLOT <slot> IMPORTING`` on the target, ``MIGRATING`` on the source, then
``GETKEYSINSLOT`` + ``MIGRATE ... KEYS`` until the source holds none of the slot's keys, then
``SETSLOT <slot> NODE <target>`` on the target, the source and every other master. While a slot is
open (importing/migrating) the source serves the keys it still has and answers ASK for the others;
a command naming several keys of the slot gets TRYAGAIN unless they are all on one side, and on
the target even with ASKING unless they all exist there. write.lua always names its shard's
``gone`` marker, which does not exist, so a shard's writes get TRYAGAIN for as long as its slot is
open (docs/design-notes.md, "Slot migration"): the moves below keep that window to a few round trips
per slot by moving many slots' bookkeeping in one pipeline and a slot's keys in as few MIGRATE calls
as ``keys_per_migrate`` allows.

A plain MIGRATE deletes the keys on the source as soon as the target has them, before the target's
replicas do: a target that died then would be replaced by a replica without them. So when the
target has replicas (``followed``: any the cluster lists, failed ones included), keys are copied
and deleted on the source only once a replica of the target acknowledges the copy (``_copy_keys``).

``plan`` is pure: which slots to move so the given masters end with equal shares.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from redis import exceptions as rx
from redis.connection import AbstractConnection

from shardlb.fanout import MARKER_TTL_MS
from shardlb.keys import SLOTS, ack_key, slot_of
from shardlb.nodes import ClusterError

MIGRATE_TIMEOUT_MS = 10_000
SLOTS_PER_ROUND = 256  # slots whose SETSLOT commands go out as one pipeline per node
REPLICA_WAIT_MS = 10_000  # how long a batch of copied keys waits for a replica of the target
COPY_ATTEMPTS = 100  # copies of one batch, each spoilt by a write on the source, before giving up
# What the source answers a batch of keys of an open slot when one changed (WATCH) or left (ASK,
# TRYAGAIN: a command naming it and others).
_CHANGED = (rx.WatchError, rx.ExecAbortError, rx.AskError, rx.TryAgainError)


@dataclass(frozen=True)
class Move:
    slot: int
    source: int  # port of the master that serves the slot now
    target: int  # port of the master that will


@dataclass
class Master:
    port: int
    id: str
    slots: list[int] = field(default_factory=list)


@dataclass
class MoveReport:
    """What ``move`` did: slots moved, keys migrated, and how long it took."""

    slots: int = 0
    keys: int = 0
    seconds: float = 0.0


def plan(owners: Mapping[int, Sequence[int]], targets: Iterable[int]) -> list[Move]:
    """The moves after which the masters in ``targets`` hold equal shares of every slot (within one),
    and masters not in ``targets`` hold none. ``owners`` is each master's slots (port -> slots).

    A master above its share gives its highest slots; masters below it take them in port order, so
    the moves are few and the ranges stay mostly contiguous.
    """
    targets = sorted(set(targets))
    if not targets:
        raise ValueError("need at least one master to hold the slots")
    total = sum(len(s) for s in owners.values())
    base, extra = divmod(total, len(targets))
    # The masters that already hold the most keep the larger shares: fewer moves.
    by_size = sorted(targets, key=lambda p: (-len(owners.get(p, ())), p))
    share = {p: base + (i < extra) for i, p in enumerate(by_size)}
    spare: list[tuple[int, int]] = []  # (slot, source)
    for port in sorted(owners):
        held = sorted(owners[port])
        keep = share.get(port, 0)
        spare.extend((slot, port) for slot in held[keep:])
    moves: list[Move] = []
    for port in targets:
        need = share[port] - min(len(owners.get(port, ())), share[port])
        for slot, source in spare[:need]:
            moves.append(Move(slot, source, port))
        del spare[:need]
    return sorted(moves, key=lambda m: m.slot)


def nodes(client: redis.Redis) -> dict[int, dict[str, Any]]:
    """Every node the node behind ``client`` knows (CLUSTER NODES as redis-py parses it), by port."""
    parsed: dict[str, dict[str, Any]] = _command(client, "CLUSTER NODES")
    return {int(address.rsplit(":", 1)[1]): info for address, info in parsed.items()}


def masters(client: redis.Redis) -> list[Master]:
    """Every live master the node behind ``client`` knows, with the slots it serves."""
    found = []
    for port, info in nodes(client).items():
        flags = info["flags"].split(",")
        if "master" not in flags or "fail" in flags or "noaddr" in flags:
            continue
        slots = [s for r in info["slots"] for s in range(int(r[0]), int(r[-1]) + 1)]
        found.append(Master(port, info["node_id"], slots))
    return sorted(found, key=lambda m: m.port)


def followed(known: Iterable[Mapping[str, Any]]) -> set[str]:
    """The ids of the masters that have a replica, of every node one node knows (CLUSTER NODES as
    redis-py parses it). A copy onto such a master waits for one of its replicas (``WAIT 1``); one
    onto a master without replicas is made as in a cluster of masters only. Every replica the
    cluster lists counts, those it has marked failed (``fail``) included: a replica frozen past
    cluster-node-timeout is marked failed, and should it come back as its primary dies, a failover
    promotes it without the copies made meanwhile (tests/test_chaos.py loses acknowledged writes
    that way when they are not waited for). So a replica gone for good stops moves onto its master
    until it is back or an operator forgets it (CLUSTER FORGET on every node), and the error says so."""
    return {n["master_id"] for n in known if "slave" in n["flags"].split(",")}


def move(
    connect: Callable[[int], redis.Redis],
    host: str,
    moves: Sequence[Move],
    password: str | None = None,
    keys_per_migrate: int = 100,
    pause_s: float = 0.0,
    replica_wait_ms: int = REPLICA_WAIT_MS,
) -> MoveReport:
    """Move each slot of ``moves`` from its source to its target, keys included.

    ``connect(port)`` gives a plain client of the node on that port. ``keys_per_migrate`` keys go in
    one MIGRATE (redis-cli's ``--cluster-pipeline``); ``pause_s`` waits after each MIGRATE of a slot
    that had keys, so a test can hold a shard half moved while writes go on. A target with replicas
    takes keys only as a replica acknowledges them, each batch within ``replica_wait_ms``
    (``_copy_keys``). Raises redis.RedisError when a node refuses, ClusterError when no replica
    acknowledges in time; the slots it left open stay open with their keys still on the source,
    and running ``move`` again with the same moves finishes them (SETSLOT and MIGRATE of what is
    left are idempotent).
    """
    started = time.monotonic()
    report = MoveReport()
    clients: dict[int, redis.Redis] = {}
    links: dict[int, AbstractConnection] = {}

    def node(port: int) -> redis.Redis:
        if port not in clients:
            clients[port] = connect(port)
        return clients[port]

    def link(port: int) -> AbstractConnection:
        """A connection of the node's own, kept out of its pool: its WATCH and WAIT stay with it."""
        if port not in links:
            links[port] = node(port).connection_pool.get_connection()
        return links[port]

    try:
        everyone = masters(node(moves[0].source)) if moves else []
        ids = {m.port: m.id for m in everyone}
        replicated = followed(nodes(node(moves[0].source)).values()) if moves else set()
        for i in range(0, len(moves), SLOTS_PER_ROUND):
            chunk = moves[i : i + SLOTS_PER_ROUND]
            # Importing first: a client the source sends to the target with ASK must find it ready.
            _each(node, chunk, lambda m: (m.target, ("IMPORTING", ids[m.source])))
            _each(node, chunk, lambda m: (m.source, ("MIGRATING", ids[m.target])))
            for m in chunk:
                if ids[m.target] in replicated:
                    report.keys += _copy_keys(
                        node(m.source),
                        link(m.target),
                        host,
                        m,
                        password,
                        keys_per_migrate,
                        pause_s,
                        replica_wait_ms,
                    )
                else:
                    report.keys += _migrate_keys(node(m.source), host, m, password, keys_per_migrate, pause_s)
            # The target first (it then owns the slot and bumps its epoch), then the source (it stops
            # answering ASK), then the others, so they redirect to the target at once.
            _each(node, chunk, lambda m: (m.target, ("NODE", ids[m.target])))
            # A master that gave its last slot away becomes the taker's replica (Redis does that
            # even with cluster-allow-replica-migration off) and then refuses SETSLOT: it has no
            # slot left to be open. To the others this is only a help: gossip tells them too.
            with _unless_replica():
                _each(node, chunk, lambda m: (m.source, ("NODE", ids[m.target])))
            for other in everyone:
                rest = [m for m in chunk if other.port not in (m.source, m.target)]
                with _unless_replica():
                    _each(node, rest, _to(other.port, lambda m: ("NODE", ids[m.target])))
            report.slots += len(chunk)
    finally:
        for conn in links.values():
            conn.disconnect()  # type: ignore[no-untyped-call]
        for c in clients.values():
            c.close()
    report.seconds = time.monotonic() - started
    return report


@contextlib.contextmanager
def _unless_replica() -> Iterator[None]:
    try:
        yield
    except redis.ResponseError as e:
        if "only with masters" not in str(e):
            raise


def _to(port: int, args: Callable[[Move], tuple[str, str]]) -> Callable[[Move], tuple[int, tuple[str, str]]]:
    return lambda m: (port, args(m))


def _each(
    node: Callable[[int], redis.Redis],
    moves: Sequence[Move],
    command: Callable[[Move], tuple[int, tuple[str, str]]],
) -> None:
    """``CLUSTER SETSLOT <slot> <state> <id>`` for each move, one pipeline per node."""
    by_port: dict[int, list[tuple[int, tuple[str, str]]]] = {}
    for m in moves:
        port, args = command(m)
        by_port.setdefault(port, []).append((m.slot, args))
    for port, commands in by_port.items():
        pipe = node(port).pipeline(transaction=False)
        for slot, args in commands:
            pipe.execute_command("CLUSTER SETSLOT", slot, *args)  # type: ignore[no-untyped-call]
        pipe.execute()


def _migrate_keys(
    source: redis.Redis, host: str, m: Move, password: str | None, per_call: int, pause_s: float
) -> int:
    """MIGRATE the slot's keys from source to a target without replicas until none is left; how
    many moved."""
    auth: tuple[str, ...] = ("AUTH", password) if password else ()
    moved = 0
    while True:
        names = _command(source, "CLUSTER GETKEYSINSLOT", m.slot, per_call)
        if not names:
            return moved
        _command(source, "MIGRATE", host, m.target, "", 0, MIGRATE_TIMEOUT_MS, *auth, "KEYS", *names)
        moved += len(names)
        if pause_s:
            time.sleep(pause_s)


def _copy_keys(
    source: redis.Redis,
    link: AbstractConnection,
    host: str,
    m: Move,
    password: str | None,
    per_call: int,
    pause_s: float,
    wait_ms: int,
) -> int:
    """Move the slot's keys to a target with replicas (``link``: a connection of it of its own)
    until none is left on the source, deleting each batch there only once a replica of the target
    holds it (``_hand_over``); how many moved."""
    auth: tuple[str, ...] = ("AUTH", password) if password else ()
    copy: tuple[str | int, ...] = ("MIGRATE", host, m.target, "", 0, MIGRATE_TIMEOUT_MS, "COPY", "REPLACE")
    moved, spoilt = 0, 0
    while names := _command(source, "CLUSTER GETKEYSINSLOT", m.slot, per_call):
        if not _hand_over(source, link, m, names, (*copy, *auth, "KEYS", *names), wait_ms):
            spoilt += 1
            if spoilt == COPY_ATTEMPTS:
                raise ClusterError(
                    f"slot {m.slot}: its keys changed on {m.source} during each of {COPY_ATTEMPTS} "
                    "copies; they stay there and the slot stays open"
                )
            continue
        moved += len(names)
        spoilt = 0
        if pause_s:
            time.sleep(pause_s)
    return moved


def _hand_over(
    source: redis.Redis,
    conn: AbstractConnection,
    m: Move,
    names: list[str],
    copy: tuple[str | int, ...],
    wait_ms: int,
) -> bool:
    """Copy ``names`` to the target, wait for a replica of it, then delete them on the source:
    False (nothing deleted, the copies dropped) when one changed on the source meanwhile.

    The copy (MIGRATE COPY REPLACE) is made under a WATCH on the source. On ``conn`` the copies
    are watched too, and the slot's ack marker is set before ``WAIT 1``: WAIT counts that
    connection's writes, and the copies came before the marker. Then the source UNLINKs the batch
    in MULTI/EXEC, in one step as MIGRATE does. Until then it still serves the keys, so one written
    or deleted there meanwhile fails the EXEC. A key deleted on the source is served by the target
    (ASK) from then on: its stale copy is dropped only if no client has touched it there since the
    copy (the target's WATCH), else ClusterError. So is a batch that no replica acknowledges within
    ``wait_ms``: its copies dropped, the keys left on the source, the slot open.
    """
    # Not the slot's ack marker: a replica-acknowledged write sets it on the source before its WAIT,
    # even when its script was refused, and the SET below sets it here. Its value means nothing.
    marker = ack_key(m.slot)
    watched = [n for n in names if n != marker]
    with source.pipeline() as pipe:
        try:
            if watched:
                pipe.watch(*watched)  # type: ignore[no-untyped-call]
        except _CHANGED:
            return False  # a key left since it was listed
        pipe.immediate_execute_command(*copy)  # type: ignore[no-untyped-call]
        *_, acks = _round(
            conn,
            ("UNWATCH",),
            *(c for n in watched for c in (("ASKING",), ("WATCH", n))),
            ("ASKING",),
            ("SET", marker, 1, "PX", MARKER_TTL_MS),
            ("WAIT", 1, wait_ms),
        )
        if acks < 1:
            _drop_copies(conn, m, names)
            raise ClusterError(
                f"slot {m.slot}: no replica of {m.target} acknowledged a copy of {len(names)} keys "
                f"within {wait_ms} ms; the keys stay on {m.source} and the slot stays open: run the "
                "move again once a replica is in sync (a replica gone for good is waited for until "
                "an operator removes it: CLUSTER FORGET its id on every node)"
            )
        pipe.multi()
        pipe.execute_command("UNLINK", *names)  # type: ignore[no-untyped-call]
        try:
            pipe.execute()
        except _CHANGED:
            _drop_copies(conn, m, names)
            return False
    return True


def _drop_copies(conn: AbstractConnection, m: Move, names: Sequence[str]) -> None:
    """Delete the target's copies of ``names`` (watched on ``conn``), unless a client changed one."""
    *_, done = _round(conn, ("ASKING",), ("MULTI",), *(("DEL", n) for n in names), ("EXEC",))
    if done is None:
        raise ClusterError(
            f"slot {m.slot}: a key of {list(names)} was deleted on {m.source} while it was being "
            f"copied, and then written on {m.target} (or its copy expired); the copies there are "
            "left as they are: check them, then run the move again"
        )


def _round(conn: AbstractConnection, *commands: tuple[str | int, ...]) -> list[Any]:
    """Send ``commands`` in one write on ``conn`` and read every reply; raise the first error."""
    conn.send_packed_command(conn.pack_commands(commands))  # type: ignore[no-untyped-call]
    replies: list[Any] = []
    for _ in commands:
        try:
            replies.append(conn.read_response())
        except redis.ResponseError as e:
            replies.append(e)
    for reply in replies:
        if isinstance(reply, redis.ResponseError):
            raise reply
    return replies


def shards_by_master(
    prefixes: Mapping[str, Sequence[str]], owner: Callable[[int], int | None]
) -> dict[int, Counter[str]]:
    """How many shards of each board each master serves: ``prefixes`` is each board's shard key
    prefixes (``Board.prefixes``), ``owner(slot)`` the port of the master serving a slot."""
    out: dict[int, Counter[str]] = {}
    for board, shard_prefixes in prefixes.items():
        for prefix in shard_prefixes:
            port = owner(slot_of(prefix))
            if port is not None:
                out.setdefault(port, Counter())[board] += 1
    return out


def owner_map(ranges: Mapping[int, Sequence[tuple[int, int]]]) -> Callable[[int], int | None]:
    """``owner(slot)`` from each master's slot ranges (port -> [(first, last)])."""
    table: list[int | None] = [None] * SLOTS
    for port, spans in ranges.items():
        for first, last in spans:
            table[first : last + 1] = [port] * (last - first + 1)
    return table.__getitem__


def _command(client: redis.Redis, *args: str | int) -> Any:
    return client.execute_command(*args)  # type: ignore[no-untyped-call]
