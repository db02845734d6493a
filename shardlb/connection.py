"""The cluster connection: the client, where a key lives, and the Lua scripts with their reload.

Everything that needs a key's slot or node, or runs a script, comes here: ``slot_of`` and
``primary_name`` read the client's slot map, and ``Script`` is the one NOSCRIPT policy (a promoted
replica starts with an empty script cache: the script is loaded again on that node only, and the
call made again). shardlb/fanout.py sends script calls through per-node pipelines first and falls
back to ``Script`` calls.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.cluster import LoadBalancingStrategy
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError
from redis.typing import EncodableT, KeyT

from shardlb import keys
from shardlb.errors import InvalidInput

_SLOTS: dict[str, int] = {}
_READ_STRATEGY: dict[int, LoadBalancingStrategy] = {}  # by id() of the client
_MAX_SLOT_CACHE = 100_000
# redis-py has been seen failing inside itself when a connection was closed under it (AttributeError
# on a closed writer after a failover; RuntimeError from uvloop's closed transport, raised in the
# event loop's code under redis-py's write): the calls that were using that connection get that,
# not a RedisError. Raised in its code, it is cluster trouble.
_REDIS_CODE = str(Path(redis.__file__).parent)
_LOOP_CODE = str(Path(asyncio.__file__).parent)


def raised_in_redis(exc: BaseException) -> bool:
    """Whether the innermost frame of the exception's traceback, past the event loop's own code
    (asyncio, uvloop), is redis-py's."""
    files = []
    tb = exc.__traceback__
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    while files and (files[-1].startswith(_LOOP_CODE) or "uvloop" in Path(files[-1]).parts):
        files.pop()
    return bool(files) and files[-1].startswith(_REDIS_CODE)


def parse_url(url: str) -> list[tuple[str, int]]:
    """``redis://[[user]:password@]host:port[,host:port...]`` as (host, port) pairs."""
    return _split_url(url)[0]


def redacted(url: str) -> str:
    """The URL with its credentials replaced by ``***``: the form to log or show."""
    scheme, sep, rest = url.partition("://")
    _, at, hosts = rest.rpartition("@")
    return f"{scheme}{sep}***@{hosts}" if at else url


def _split_url(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """The seed nodes, the user name and the password of a cluster URL.

    Credentials (percent-encoded where needed) come once, before the first node, and hold for
    every node. Error messages never repeat them: they end up in logs and start-up errors.
    """
    scheme, _, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if not at:
        hosts = rest
    if "," in userinfo:  # an @ after the first host, or a comma that should have been %2C
        raise InvalidInput(
            "give the credentials once, before the first host (redis://:password@host:port,...), "
            "with any , @ : / in them percent-encoded",
            "SHARDLB_REDIS_URL",
        )
    if scheme not in ("redis", "rediss") or not hosts:
        shown = f"{scheme}://{'***@' if at else ''}{hosts}"
        raise InvalidInput(f"expected redis://host:port[,host:port...], got {shown!r}", "SHARDLB_REDIS_URL")
    nodes = []
    for part in hosts.strip("/").split(","):
        parsed = urlsplit(f"redis://{part}")
        try:
            port = parsed.port or 6379
        except ValueError as e:
            raise InvalidInput(f"bad port in {part!r}", "SHARDLB_REDIS_URL") from e
        if not parsed.hostname:
            raise InvalidInput(f"missing host in {part!r}", "SHARDLB_REDIS_URL")
        nodes.append((parsed.hostname, port))
    if not at:
        return nodes, None, None
    user, colon, password = userinfo.partition(":")
    return nodes, unquote(user) or None, unquote(password) if colon else None


def has_password(url: str) -> bool:
    """Whether the URL carries a password."""
    return _split_url(url)[2] is not None


# SHARDLB_READ_FROM: where board reads (shardlb/reads.py) are sent. Replicas may be behind their
# primary by the replication lag (router/README.md, "Reads from replicas").
READ_FROM = {
    "primary": None,
    "replicas": LoadBalancingStrategy.ROUND_ROBIN_REPLICAS,
    "any": LoadBalancingStrategy.ROUND_ROBIN,
}


def read_strategy(client: RedisCluster) -> LoadBalancingStrategy | None:
    """How ``connect`` was asked to spread board reads over each primary's replicas (None: primaries)."""
    return _READ_STRATEGY.get(id(client))


def connect(
    url: str,
    max_connections: int = 64,
    timeout: float = 2.0,
    decode: bool = True,
    password: str | None = None,
    read_from: str = "primary",
) -> RedisCluster:
    """A cluster client with deliberate timeouts and a connection cap (we queue in front of it).

    The URL's user name and password (or ``password``, or else the SHARDLB_REDIS_PASSWORD variable,
    when the URL has none) go to every node: redis-py gives each node it discovers, and each
    per-node pipeline connection, the connection settings given here. ``decode=False`` leaves
    replies as bytes (the journal's entries carry MessagePack).

    ``read_from`` (``READ_FROM``) other than ``primary`` makes every connection READONLY, so that the
    board reads of ``fanout.Batch(..., replicas=True)`` may go to replicas; everything else the client
    sends (writes, the board registry, redis-py's own commands) still goes to the primaries."""
    nodes, username, url_password = _split_url(url)
    if url_password is not None:
        password = url_password
    elif password is None:
        # One home for the variable: every tool that connects with the URL alone (archiver, rebuild,
        # reconcile, settlement, the router's journal watcher) authenticates as the router does.
        password = os.environ.get("SHARDLB_REDIS_PASSWORD") or None
    strategy = READ_FROM[read_from]
    client = RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in nodes],
        username=username,
        password=password,
        decode_responses=decode,
        max_connections=max_connections,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        load_balancing_strategy=strategy,
        # On a MOVED, only patch that slot's entry. The default (every 5th MOVED) reloads the map by
        # closing every connection of every node, calls in flight included: a rebalance, which
        # answers MOVED for every slot that moved, then fails calls all along (docs/design-notes.md,
        # "Slot migration"). A connection error still reloads the whole map.
        reinitialize_steps=0,
    )
    if strategy is not None:
        # The strategy made redis-py open READONLY connections; its own routing stays on primaries.
        client.load_balancing_strategy = None
        _READ_STRATEGY[id(client)] = strategy
        weakref.finalize(client, _READ_STRATEGY.pop, id(client), None)
    return client


def slot_of(key: str) -> int:
    """The cluster slot of ``key`` (``keys.slot_of``), cached: a board's keys recur on every call."""
    slot = _SLOTS.get(key)
    if slot is None:
        if len(_SLOTS) >= _MAX_SLOT_CACHE:
            _SLOTS.clear()
        slot = _SLOTS[key] = keys.slot_of(key)
    return slot


def node_of(client: RedisCluster, key: str) -> ClusterNode:
    """The primary serving ``key`` in the client's slot map."""
    return client.nodes_manager.get_node_from_slot(slot_of(key))


def primary_name(client: RedisCluster, key: str) -> str:
    """The name of the primary serving ``key`` ("unknown" while the slot map is being refreshed:
    callers that bound work per primary then share one bound)."""
    try:
        return str(node_of(client, key).name)
    except Exception:
        return "unknown"


def primary_names(client: RedisCluster) -> set[str]:
    """The names of the primaries in the client's slot map (those ``primary_name`` may give)."""
    return {str(node.name) for node in client.get_primaries()}


class Script(AsyncScript):
    """A Lua script of a cluster. On NOSCRIPT it is loaded again on the node that answered only (one
    connection, where ``AsyncScript`` loads it on every primary) and the call is made again."""

    def __init__(self, client: RedisCluster, script: str) -> None:
        super().__init__(client, script)
        self.cluster = client

    async def __call__(
        self,
        keys: Sequence[KeyT] | None = None,
        args: Iterable[EncodableT] | None = None,
        client: Any = None,
    ) -> Any:
        names = list(keys or [])
        return await self.run(len(names), [*names, *(args or [])])

    async def run(self, numkeys: int, values: list[Any]) -> Any:
        try:
            return await self.cluster.evalsha(self.sha, numkeys, *values)
        except NoScriptError:
            await self.reload(str(values[0]) if numkeys else None)
            return await self.cluster.evalsha(self.sha, numkeys, *values)

    async def reload(self, key: str | None) -> None:
        """Load the script again on the primary of ``key`` (on every primary without a key)."""
        if key is None:
            self.sha = await self.cluster.script_load(self.script)
        else:
            node = node_of(self.cluster, key)
            self.sha = await self.cluster.execute_command("SCRIPT LOAD", self.script, target_nodes=node)


def script_source(name: str) -> str:
    return resources.files("shardlb.scripts").joinpath(name).read_text()


# Scripts made of another's source with flags of their own (a `#!lua` line, which must come
# first): registry.lua for a deletion's calls, which a primary out of memory runs (registry.lua
# takes only a removal or a mark "deleting" from them, a bounded write).
_FLAGGED = {"registry_freeing": ("registry.lua", "#!lua flags=allow-oom\n")}


def _source(field: str) -> str:
    name, flags = _FLAGGED.get(field, (f"{field}.lua", ""))
    return flags + script_source(name)


@dataclass
class Scripts:
    """The board's Lua scripts (shardlb/scripts/*.lua). ``load`` puts them on every primary before
    the first call (concurrent first uses would race, redis-py #3935)."""

    write: Script
    band: Script
    settle: Script
    counts: Script
    near: Script
    places: Script
    drop: Script
    registry: Script
    registry_freeing: Script  # registry.lua as a deletion's calls make it: run out of memory too
    marker: Script
    owe: Script
    digests: Script
    rebuild: Script
    remove: Script
    rate: Script
    freeze: Script
    ack: Script
    recount: Script
    forget: Script
    prune: Script
    poll: Script
    trim: Script

    @classmethod
    def register(cls, client: RedisCluster) -> Scripts:
        return cls(**{f.name: Script(client, _source(f.name)) for f in fields(cls)})

    async def load(self, client: RedisCluster) -> None:
        await client.initialize()
        for f in fields(self):
            script = getattr(self, f.name)
            script.sha = await client.script_load(script.script)
        if read_strategy(client) is not None and client.get_replicas():
            # counts.lua, near.lua and places.lua are the scripts board reads send to replicas
            # (no-writes; SCRIPT LOAD on a primary does not reach them). A replica that lost one
            # (started again) answers NOSCRIPT: that read falls back to the primary, and the script
            # is loaded on the replica for the next (fanout.Batch.load_scripts).
            for script in (self.counts, self.near, self.places):
                await client.execute_command("SCRIPT LOAD", script.script, target_nodes=client.get_replicas())


def connection_arguments(command: argparse.ArgumentParser) -> None:
    """``--redis`` and ``--postgres`` for a command that reaches the cluster and the archive, with
    the environment's SHARDLB_REDIS_URL and SHARDLB_POSTGRES_URL as defaults."""
    command.add_argument(
        "--redis",
        default=os.environ.get("SHARDLB_REDIS_URL", "redis://127.0.0.1:7000"),
        help="the cluster (default $SHARDLB_REDIS_URL or redis://127.0.0.1:7000)",
    )
    command.add_argument(
        "--postgres",
        type=postgres_url,
        default=os.environ.get("SHARDLB_POSTGRES_URL"),
        help="the archive (default $SHARDLB_POSTGRES_URL)",
    )


def postgres_url(text: str) -> str:
    """An argparse type: a PostgreSQL URL or connection string libpq can parse. One it cannot is a
    usage error (exit status 2), not the unreachable server (1) psycopg's error would pass for, or
    that `shardlb archive` would retry for ever as "not reachable yet"."""
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict  # imported when used, as the commands do

    try:
        conninfo_to_dict(text)
    except ProgrammingError as e:
        raise argparse.ArgumentTypeError(f"not a PostgreSQL URL: {postgres_url_error(e, text)}") from e
    return text


_QUOTED = re.compile(r'"([^"]*)"')
_KEYWORD_PASSWORD = re.compile(r"\bpassword\s*=\s*('(?:[^'\\]|\\.)*'?|\S*)")


def postgres_url_error(error: BaseException, url: str) -> str:
    """libpq's reason for refusing ``url`` (a URL or a ``key=value`` string), without its password:
    libpq quotes what it could not read, the whole URL or the password's own token, and the
    message goes to stderr at start-up, a pod's or a cron job's log. Only the quoted parts are
    searched, so a short password does not blank the words around them."""
    text = str(error).strip()
    if "://" in url:
        userinfo, at, _ = url.partition("://")[2].rpartition("@")
        raw = userinfo.partition(":")[2] if at else ""
    else:
        found = _KEYWORD_PASSWORD.search(url)
        raw = found.group(1).strip("'") if found else ""
    secrets = {s for s in (raw, unquote(raw)) if s}
    if not secrets:
        return text

    def hidden(quoted: re.Match[str]) -> str:
        part = quoted.group(1).replace(url, redacted(url))
        for secret in secrets:
            part = part.replace(secret, "***")
        return f'"{part}"'

    return _QUOTED.sub(hidden, text)


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, 0 or more (NaN would make a deadline no clock
    reaches)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"seconds must be 0 or more, got {text!r}")
    return value
