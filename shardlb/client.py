"""The cluster client and the Lua scripts, set up once per process before any request."""

from __future__ import annotations

from dataclasses import dataclass, fields
from importlib import resources
from urllib.parse import urlsplit

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.commands.core import AsyncScript

from shardlb.errors import InvalidInput


def parse_url(url: str) -> list[tuple[str, int]]:
    """``redis://host:port[,host:port...]`` as (host, port) pairs."""
    scheme, _, rest = url.partition("://")
    if scheme not in ("redis", "rediss") or not rest:
        raise InvalidInput(f"expected redis://host:port[,host:port...], got {url!r}", "SHARDLB_REDIS_URL")
    nodes = []
    for part in rest.strip("/").split(","):
        parsed = urlsplit(f"redis://{part}")
        try:
            port = parsed.port or 6379
        except ValueError as e:
            raise InvalidInput(f"bad port in {part!r}", "SHARDLB_REDIS_URL") from e
        if not parsed.hostname:
            raise InvalidInput(f"missing host in {part!r}", "SHARDLB_REDIS_URL")
        nodes.append((parsed.hostname, port))
    return nodes


def connect(url: str, max_connections: int = 64, timeout: float = 2.0) -> RedisCluster:
    """A cluster client with deliberate timeouts and a connection cap (we queue in front of it)."""
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in parse_url(url)],
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
