"""The cluster client and the Lua scripts, set up once per process before any request."""

from __future__ import annotations

from dataclasses import dataclass, fields
from importlib import resources
from urllib.parse import unquote, urlsplit

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.commands.core import AsyncScript

from shardlb.errors import InvalidInput


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


def connect(url: str, max_connections: int = 64, timeout: float = 2.0) -> RedisCluster:
    """A cluster client with deliberate timeouts and a connection cap (we queue in front of it).

    The URL's user name and password go to every node: redis-py gives each node it discovers,
    and each per-node pipeline connection, the connection settings given here."""
    nodes, username, password = _split_url(url)
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in nodes],
        username=username,
        password=password,
        decode_responses=True,
        max_connections=max_connections,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
    )


def _source(name: str) -> str:
    return resources.files("shardlb.scripts").joinpath(name).read_text()


@dataclass
class Scripts:
    """The board's Lua scripts. ``load`` puts them on every primary; AsyncScript reloads on NOSCRIPT
    (a promoted replica starts with an empty script cache)."""

    write: AsyncScript
    band: AsyncScript
    settle: AsyncScript
    counts: AsyncScript
    drop: AsyncScript
    registry: AsyncScript

    @classmethod
    def register(cls, client: RedisCluster) -> Scripts:
        return cls(**{f.name: client.register_script(_source(f"{f.name}.lua")) for f in fields(cls)})

    async def load(self, client: RedisCluster) -> None:
        await client.initialize()
        for f in fields(self):
            script = getattr(self, f.name)
            script.sha = await client.script_load(script.script)
