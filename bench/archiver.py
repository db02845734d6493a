"""The archiver as its own process, so that the bench meters its CPU like the router's and Redis's.

    python -m bench.archiver --redis URL --postgres URL [--name NAME]

``Archiver.run`` over every journaled board until SIGTERM or SIGINT: what `shardlb archive` runs.
The cluster clients are initialised before the archiver's first round, which reads every journal at
once: redis-py 8.1's cluster client fails (ConnectionError, or AttributeError on a closed node) when
its first commands run concurrently before it has read the cluster's slots.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from shardlb import archive
from shardlb.connection import Scripts, connect
from shardlb.store import BoardStore


async def _run(redis_url: str, postgres_url: str, name: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    raw = connect(redis_url, decode=False)  # journal entries carry MessagePack
    client = connect(redis_url)
    await raw.initialize()
    await client.initialize()
    scripts = Scripts.register(client)
    await scripts.load(client)
    db = await archive.connect_db(postgres_url)
    try:
        await archive.Archiver(raw, BoardStore(client, scripts), db, name).run(stop)
    finally:
        await db.close()
        await raw.aclose()
        await client.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.archiver", description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", required=True)
    parser.add_argument("--postgres", required=True)
    parser.add_argument("--name", default=f"bench-{os.getpid()}", help="consumer name")
    args = parser.parse_args(argv)
    asyncio.run(_run(args.redis, args.postgres, args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
