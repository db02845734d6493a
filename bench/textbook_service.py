"""The textbook leaderboard service, for the hot-read phase of `make bench` (bench/hot.py).

What most tutorials show: a small Starlette app over ONE sorted set, on a plain connection to the
one Redis master that holds it. "My rank" is ZSCORE + ZREVRANK + ZCARD in one pipeline; the top is
one ZREVRANGE. No keys, no rate limit, no metrics, no access log, no period or input checks beyond
what the answer needs: the floor that shardlb's router, which does all of those, is compared with.

Run: ``python -m bench.textbook_service --port P --redis-url URL --key KEY`` (uvicorn, one process).
"""

from __future__ import annotations

import argparse
import asyncio

import orjson
import redis.asyncio as aioredis
import uvicorn
from redis.asyncio.cluster import RedisCluster
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from shardlb.connection import connect, slot_of


def _json(body: object, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status, media_type="application/json")


def create_app(client: aioredis.Redis, key: str) -> Starlette:
    async def rank(request: Request) -> Response:
        player = request.path_params["player"]
        pipe = client.pipeline(transaction=False)
        pipe.zscore(key, player)
        pipe.zrevrank(key, player)
        pipe.zcard(key)
        score, position, players = await pipe.execute()
        if score is None:
            return _json({"error": {"code": "player_not_found"}}, 404)
        return _json({"player_id": player, "rank": position + 1, "score": score, "players": players})

    async def top(request: Request) -> Response:
        rows = await client.zrevrange(key, 0, 99, withscores=True)
        entries = [{"rank": i + 1, "player_id": m, "score": s} for i, (m, s) in enumerate(rows)]
        return _json({"entries": entries})

    async def healthz(request: Request) -> Response:
        return Response(b"ok", media_type="text/plain")

    return Starlette(
        routes=[
            Route("/players/{player}", rank),
            Route("/top", top),
            Route("/healthz", healthz),
        ]
    )


async def _master_of(url: str, key: str) -> tuple[str, int]:
    """The host and port of the master that holds ``key``'s slot."""
    cluster: RedisCluster = connect(url)
    try:
        await cluster.initialize()
        node = cluster.nodes_manager.get_node_from_slot(slot_of(key))
        return node.host, node.port
    finally:
        await cluster.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--key", required=True)
    args = parser.parse_args()
    host, port = asyncio.run(_master_of(args.redis_url, args.key))
    client = aioredis.Redis(host=host, port=port, decode_responses=True, max_connections=64)
    app = create_app(client, args.key)
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
