"""`make bench-dedup`: what an `incr` board's dedup records cost in Redis memory and CPU.

    SHARDLB_DEDUP_RESULTS=1000000 python -m bench.dedup

Every board here keeps no journal (``durability: memory``): a journal's entries, which nothing
archives here, would count in used_memory beside the records measured.

An incr board remembers every (match, player) it applied for its dedup window, as members
``<match_id>\\0<player_id>`` of one set per shard and time bucket (shardlb/board.py, write.lua). On a
one-master cluster of its own, this bench:

1. memory: writes SHARDLB_DEDUP_RESULTS incr results (UUID match ids, 17-digit player ids drawn
   from SHARDLB_DEDUP_PLAYERS players) through the library onto a one-shard board, all in one
   bucket, and at every tenth of the load records the bytes per member two ways: INFO used_memory
   after minus before, less the board's sorted set (MEMORY USAGE), and MEMORY USAGE ... SAMPLES 0 of
   the dedup set itself. A large set is a hash table whose slot array doubles when it fills, so the
   cost per member swings by about 8 bytes between a just-doubled and a full table: the mean over the
   checkpoints of the second half of the load (one doubling, and fixed overheads spread thin) is the
   planner's `bytes_per_dedup_member`.
   These results carry their ``achieved_at``, so they keep no pin.
2. pins: as many results without ``achieved_at`` on a one-shard best board, all in one pin hash
   (each keeps its first server time there: docs/design-notes.md, "Retries without
   `achieved_at`"); INFO used_memory after minus before, less the sorted set, per pin is the
   planner's ``bytes_per_pin``.
3. CPU: the master's CPU (INFO cpu, user + system) per incr result with the bucket counts in
   SHARDLB_DEDUP_BUCKETS (4,24): each extra bucket is one more SISMEMBER per new result (results
   with their time: no pin lookups).
4. encodings: the same number of members written straight with SADD as they are today, as 16-byte
   digests, and as 64-bit integers spread over sets small enough for Redis's compact intset
   encoding (set-max-intset-entries, 512 by default): what a smaller member would save.

Results: bench/results/dedup-<timestamp>/dedup.{json,md}, copied to bench/results/latest/.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import shutil
import sys
import time
import uuid
from typing import Any

import redis

from bench.harness import env_int, env_ints, log, publish, run_dir
from bench.testbed import machine, start_cluster
from shardlb import keys, times
from shardlb.board import Board, Score
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.store import BoardStore

BATCH = 5000
CHECKPOINTS = 10
INTSET_FILL = 256  # members per small set: half of set-max-intset-entries, so none passes 512
STEAM_BASE = 76_561_197_960_265_728  # player ids shaped like 17-digit platform account ids


def results_batch(rng: random.Random, n: int, players: int, achieved_ms: int | None = None) -> list[Score]:
    """``n`` results of new matches; ``achieved_ms`` None leaves their time to the server (each then
    keeps a pin as well as its dedup record: write.lua)."""
    return [
        Score(
            str(STEAM_BASE + rng.randrange(players)),
            rng.randrange(1, 100),
            str(uuid.UUID(int=rng.getrandbits(128))),
            achieved_ms,
        )
        for _ in range(n)
    ]


def node_client(url: str) -> redis.Redis:
    host, _, port = url.removeprefix("redis://").split(",")[0].partition(":")
    return redis.Redis(host=host, port=int(port))


def used_memory(node: redis.Redis) -> int:
    return int(node.info("memory")["used_memory"])


def cpu_seconds(node: redis.Redis) -> float:
    info = node.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def memory_usage(node: redis.Redis, key: str) -> int:
    return int(node.memory_usage(key, samples=0) or 0)


async def open_board(url: str, config: BoardConfig) -> tuple[Board, Any]:
    client = connect(url)
    scripts = Scripts.register(client)
    await scripts.load(client)
    board, _ = await BoardStore(client, scripts).create(config)
    return board, client


async def memory_per_member(url: str, node: redis.Redis, results: int, players: int) -> dict[str, Any]:
    config = BoardConfig.from_dict(
        "dedup-memory",
        {"mode": "incr", "durability": "memory", "sharding": {"strategy": "hash", "shards": 1}},
    )
    board, client = await open_board(url, config)
    rng = random.Random(5)
    now = times.now_ms()
    prefix = board.prefixes[0]
    try:
        timed = now - 1000  # with their time: the dedup records alone, no pins
        await board.submit(results_batch(rng, 1, players, timed), now_ms=now)  # scripts and keys in place
        base = used_memory(node)
        total_base = memory_usage(node, keys.period_key(prefix, "total"))
        points = []
        done = 1
        step = max(BATCH, results // CHECKPOINTS)
        for target in range(step, results + 1, step):
            while done < target:
                n = min(BATCH, target - done)
                await board.submit(results_batch(rng, n, players, timed), now_ms=now)
                done += n
            (dd,) = node.keys(prefix.replace("{", "\\{").replace("}", "\\}") + "dd:*")
            members = int(node.scard(dd))
            total = memory_usage(node, keys.period_key(prefix, "total")) - total_base
            used = used_memory(node) - base - total
            points.append(
                {
                    "members": members,
                    "encoding": node.object("encoding", dd).decode(),
                    "used_memory_bytes_per_member": round(used / members, 1),
                    "memory_usage_bytes_per_member": round(memory_usage(node, dd) / members, 1),
                }
            )
            log(f"{members:,} dedup members: {points[-1]}")
        sample = f"{uuid.UUID(int=0)}\0{STEAM_BASE}"
        return {"member_bytes": len(sample.encode()), "points": points}
    finally:
        await client.aclose()


async def memory_per_pin(url: str, node: redis.Redis, results: int, players: int) -> dict[str, Any]:
    """Bytes per pin: ``results`` results without a time on a one-shard best board, all in one pin
    hash; INFO used_memory after minus before, less the board's sorted set."""
    config = BoardConfig.from_dict(
        "pin-memory", {"mode": "best", "durability": "memory", "sharding": {"strategy": "hash", "shards": 1}}
    )
    board, client = await open_board(url, config)
    rng = random.Random(6)
    now = times.now_ms()
    prefix = board.prefixes[0]
    try:
        await board.submit(results_batch(rng, 1, players), now_ms=now)
        base = used_memory(node)
        total_base = memory_usage(node, keys.period_key(prefix, "total"))
        for start in range(1, results, BATCH):
            await board.submit(results_batch(rng, min(BATCH, results - start), players), now_ms=now)
        (pins,) = node.keys(prefix.replace("{", "\\{").replace("}", "\\}") + "pin:*")
        members = int(node.hlen(pins))
        total = memory_usage(node, keys.period_key(prefix, "total")) - total_base
        used = used_memory(node) - base - total
        out = {
            "pins": members,
            "encoding": node.object("encoding", pins).decode(),
            "used_memory_bytes_per_pin": round(used / (members - 1), 1),
            "memory_usage_bytes_per_pin": round(memory_usage(node, pins) / members, 1),
        }
        log(f"{members:,} pins: {out}")
        return out
    finally:
        await client.aclose()


async def cpu_per_bucket_count(
    url: str, node: redis.Redis, results: int, players: int, counts: list[int]
) -> list[dict[str, Any]]:
    out = []
    for k in counts:
        config = BoardConfig.from_dict(
            f"dedup-cpu-{k}",
            {"mode": "incr", "durability": "memory", "sharding": {"strategy": "hash", "shards": 1}},
        )
        board, client = await open_board(url, config)
        try:
            # The bucket length is fixed per board by the library (a quarter of the window); set it
            # here to see what more, shorter buckets cost. Fail loudly if the library renamed it.
            if not hasattr(board, "_dedup_bucket_ms"):
                raise SystemExit("shardlb.board.Board has no _dedup_bucket_ms: update bench/dedup.py")
            board._dedup_bucket_ms = config.dedup_window_s * 1000 // k
            rng = random.Random(7)
            now = times.now_ms()
            timed = now - 1000  # with their time: dedup lookups alone, no pins
            await board.submit(results_batch(rng, 1, players, timed), now_ms=now)
            before = cpu_seconds(node)
            for start in range(0, results, BATCH):
                await board.submit(
                    results_batch(rng, min(BATCH, results - start), players, timed), now_ms=now
                )
            us = (cpu_seconds(node) - before) / results * 1e6
            out.append({"buckets": k, "lookups": k + 1, "redis_us_per_result": round(us, 2)})
            log(f"{k} buckets: {us:.2f} us of Redis CPU per new incr result")
        finally:
            await client.aclose()
        node.flushall()
    return out


def encodings(node: redis.Redis, members: int) -> list[dict[str, Any]]:
    """Bytes per member of one set per bucket today, of 16-byte digests, and of int64 intsets."""
    rng = random.Random(9)
    pairs = [
        (str(uuid.UUID(int=rng.getrandbits(128))), str(STEAM_BASE + rng.randrange(10**6)))
        for _ in range(members)
    ]
    subsets = max(1, members // INTSET_FILL)

    def strings(pipe: Any, match: str, player: str) -> None:
        pipe.sadd("enc:str", f"{match}\0{player}")

    def digest16(pipe: Any, match: str, player: str) -> None:
        pipe.sadd("enc:d16", hashlib.blake2b(f"{match}\0{player}".encode(), digest_size=16).digest())

    def intsets(pipe: Any, match: str, player: str) -> None:
        d = hashlib.blake2b(f"{match}\0{player}".encode(), digest_size=16).digest()
        value = int.from_bytes(d[:8], "big", signed=True)
        pipe.sadd(f"enc:i64:{int.from_bytes(d[8:], 'big') % subsets}", value)

    out = []
    for name, add, shape in (
        ("match\\0player string, one set (today)", strings, "1 set"),
        ("16-byte digest, one set", digest16, "1 set"),
        ("64-bit integer, small intsets", intsets, f"{subsets:,} sets of ~{INTSET_FILL}"),
    ):
        node.flushall()
        before = used_memory(node)
        for start in range(0, members, BATCH):
            pipe = node.pipeline(transaction=False)
            for match, player in pairs[start : start + BATCH]:
                add(pipe, match, player)
            pipe.execute()
        sample = node.randomkey()
        per = (used_memory(node) - before) / members
        out.append(
            {
                "member": name,
                "shape": shape,
                "encoding": node.object("encoding", sample).decode() if sample else "",
                "bytes_per_member": round(per, 1),
            }
        )
        log(f"{name}: {per:.1f} bytes per member")
    node.flushall()
    return out


def markdown(result: dict[str, Any]) -> str:
    mem = result["memory"]
    lines = [
        f"# shardlb bench-dedup {result['name']}",
        "",
        f"Machine: {result['machine']['cpus']} CPUs; {result['machine']['redis']}. One master, no replica.",
        "",
        f"## Memory per dedup member (incr results through the library, one bucket; member "
        f"`<uuid>\\0<17-digit id>` = {mem['member_bytes']} bytes)",
        "",
        "| members in the bucket | encoding | bytes/member (used_memory) | bytes/member (MEMORY USAGE) |",
        "|---:|---|---:|---:|",
        *(
            f"| {p['members']:,} | {p['encoding']} | {p['used_memory_bytes_per_member']} | "
            f"{p['memory_usage_bytes_per_member']} |"
            for p in mem["points"]
        ),
        "",
        f"Mean over the checkpoints from half the load on (the planner's `bytes_per_dedup_member`): "
        f"**{result['bytes_per_dedup_member']}** bytes (used_memory).",
        "",
        f"## Memory per pin (results without `achieved_at` on a best board, one pin hash of "
        f"{result['pin_memory']['pins']:,})",
        "",
        f"**{result['pin_memory']['used_memory_bytes_per_pin']}** bytes per pin (used_memory; "
        f"{result['pin_memory']['memory_usage_bytes_per_pin']} by MEMORY USAGE of the hash, "
        f"{result['pin_memory']['encoding']}): the planner's `bytes_per_pin`.",
        "",
        "## Redis CPU per new incr result by dedup bucket count",
        "",
        "| buckets | SISMEMBER per new result | Redis µs per result |",
        "|---:|---:|---:|",
        *(f"| {c['buckets']} | {c['lookups']} | {c['redis_us_per_result']} |" for c in result["cpu"]),
        "",
        "## Other member encodings (raw SADD, same number of members)",
        "",
        "| member | sets | encoding | bytes/member |",
        "|---|---|---|---:|",
        *(
            f"| {e['member']} | {e['shape']} | {e['encoding']} | {e['bytes_per_member']} |"
            for e in result["encodings"]
        ),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    results = env_int("SHARDLB_DEDUP_RESULTS", 1_000_000)
    players = env_int("SHARDLB_DEDUP_PLAYERS", 10_000)
    cpu_results = env_int("SHARDLB_DEDUP_CPU_RESULTS", 200_000)
    counts = env_ints("SHARDLB_DEDUP_BUCKETS", "4,24")
    name = time.strftime("dedup-%Y%m%d-%H%M%S")
    out = run_dir(name)
    cluster = start_cluster(1, 0, out / "cluster", start=22100)
    node = node_client(cluster.url)
    try:
        memory = asyncio.run(memory_per_member(cluster.url, node, results, players))
        node.flushall()
        pins = asyncio.run(memory_per_pin(cluster.url, node, results, players))
        node.flushall()
        cpu = asyncio.run(cpu_per_bucket_count(cluster.url, node, cpu_results, players, counts))
        enc = encodings(node, results)
    finally:
        node.close()
        cluster.down()
        shutil.rmtree(out / "cluster", ignore_errors=True)
    per = [p["used_memory_bytes_per_member"] for p in memory["points"] if p["members"] * 2 >= results]
    result = {
        "name": name,
        "machine": machine(),
        "results": results,
        "players": players,
        "memory": memory,
        "bytes_per_dedup_member": round(sum(per) / len(per), 1),
        "pin_memory": pins,
        "bytes_per_pin": pins["used_memory_bytes_per_pin"],
        "cpu": cpu,
        "encodings": enc,
    }
    (out / "dedup.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "dedup.md").write_text(markdown(result))
    publish(out, ("dedup.json", "dedup.md"))
    print((out / "dedup.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
