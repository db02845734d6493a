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

from shardlb.keys import SLOTS, slot_of

MIGRATE_TIMEOUT_MS = 10_000
SLOTS_PER_ROUND = 256  # slots whose SETSLOT commands go out as one pipeline per node


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


def move(
    connect: Callable[[int], redis.Redis],
    host: str,
    moves: Sequence[Move],
    password: str | None = None,
    keys_per_migrate: int = 100,
    pause_s: float = 0.0,
) -> MoveReport:
    """Move each slot of ``moves`` from its source to its target, keys included.

    ``connect(port)`` gives a plain client of the node on that port. ``keys_per_migrate`` keys go in
    one MIGRATE (redis-cli's ``--cluster-pipeline``); ``pause_s`` waits after each MIGRATE of a slot
    that had keys, so a test can hold a shard half moved while writes go on. Raises
    redis.RedisError when a node refuses; the slots it left open stay open, and running ``move``
    again with the same moves finishes them (SETSLOT and MIGRATE of what is left are idempotent).
    """
    started = time.monotonic()
    report = MoveReport()
    clients: dict[int, redis.Redis] = {}

    def node(port: int) -> redis.Redis:
        if port not in clients:
            clients[port] = connect(port)
        return clients[port]

    try:
        everyone = masters(node(moves[0].source)) if moves else []
        ids = {m.port: m.id for m in everyone}
        for i in range(0, len(moves), SLOTS_PER_ROUND):
            chunk = moves[i : i + SLOTS_PER_ROUND]
            # Importing first: a client the source sends to the target with ASK must find it ready.
            _each(node, chunk, lambda m: (m.target, ("IMPORTING", ids[m.source])))
            _each(node, chunk, lambda m: (m.source, ("MIGRATING", ids[m.target])))
            for m in chunk:
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
    """MIGRATE the slot's keys from source to the target until none is left; how many moved."""
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
