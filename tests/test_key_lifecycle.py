"""What a board leaves in Redis once it is deleted (bounded memory: docs/design-notes.md).

Each board kind (hash, band, region; with dated periods) is made to write every kind of key it can:
scores with and without a time (dedup sets, pins), a removal (its records, and a band board's
removed versions), a ban of one board, the per-minute rate counters, the activity set, a frozen
period. Then it is deleted, and every master of the cluster is scanned for keys of the board: only
the markers documented to stay may remain (the shards' `gone`, the deletion's mark), each with a
time to live, and the ban list holds no ban of it. The same after a season archive (which closes
the board first: `frozen:total`, no expiry) and after a reshard (the old layout dropped at the move,
its moved markers kept a day) followed by the deletion.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio

from shardlb import keys, moderation, settlement, times
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.reshard import Resharder
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running
from tests.test_settlement import drain

pytestmark = pytest.mark.cluster

# What a deleted board may leave behind, by the end of the key's name: each expires.
STAYING = {"gone", "deleted"}


async def leftovers(store: BoardStore, board: str) -> dict[str, int]:
    """Every key naming ``board`` on every master, with its time to live in ms (-1: none): each
    master SCANned on its own connection, whatever the cluster client's idea of the slots."""
    await store.client.initialize()
    found: dict[str, int] = {}
    for node in store.client.get_primaries():
        conn = redis.asyncio.Redis(host=node.host, port=node.port, decode_responses=True)
        try:
            async for key in conn.scan_iter(match=f"*{board}*", count=1000):
                found[key] = await conn.pttl(key)
        finally:
            await conn.aclose()
    return found


def undocumented(left: dict[str, int]) -> dict[str, int]:
    """The keys of ``left`` that are not documented to stay, or do not expire."""
    return {
        k: ttl
        for k, ttl in left.items()
        if ttl <= 0 or not any(k.endswith(":" + s) or k.startswith(f"lb:{s}:") for s in STAYING)
    }


SHARDINGS = {
    "hash": {"strategy": "hash", "shards": 3},
    "band": {"strategy": "band", "bands": [0, 50, 100]},
    "region": {"strategy": "region", "regions": ["eu", "na"], "shards_per_region": 2},
}


@pytest.mark.parametrize("strategy", sorted(SHARDINGS))
async def test_a_deleted_board_leaves_only_expiring_markers(
    cluster_url: str, postgres_url: str, store: BoardStore, strategy: str
) -> None:
    name = board_name(f"keys-{strategy}")
    body = {
        "mode": "incr",
        "periods": ["daily", "weekly", "monthly"],
        "sharding": SHARDINGS[strategy],
        "max_results_per_player_per_minute": 50,
        "inactive_after": 86_400,
    }
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        r = await client.put(f"/v1/boards/{name}", json=body, headers=AS_ADMIN)
        assert r.status_code == 201, r.text
        try:
            now = times.now_ms()
            scores: list[dict[str, Any]] = []
            for i in range(30):
                s: dict[str, Any] = {"player_id": f"p{i}", "points": 10 + 7 * i, "match_id": f"m{i}"}
                if i % 2:
                    s["achieved_at"] = now - 1000 * i  # the others get the server's time: pinned
                if strategy == "region":
                    s["region"] = ("eu", "na")[i % 2]
                scores.append(s)
            for _ in range(2):  # the second time: duplicates
                r = await client.post(f"/v1/boards/{name}/scores", json={"scores": scores}, headers=AS_WRITER)
                assert r.status_code == 200, r.text
            r = await client.delete(f"/v1/boards/{name}/players/p3", headers=AS_ADMIN)
            assert r.status_code in (200, 204), r.text
            ban = {"scope": "board", "board": name}
            r = await client.post("/v1/players/p4:ban", json=ban, headers=AS_ADMIN)
            assert r.status_code == 200, r.text
            board = await store.get(name)
            yesterday = board.resolve("daily:" + times.format_ms(now - 86_400_000)[:10]).period
            await board.freeze(yesterday)
            # Every kind of key a board of this kind writes is there before the deletion.
            kinds = {k.split(":", 5)[-1].split(":")[0] for k in await leftovers(store, name)}
            wrote = {"total", "d", "w", "m", "idx", "dd", "pin", "pspan", "rmv", "rmvon", "seen"}
            wrote |= {"rate", "rated", "frozen", "log", "logn"}
            assert wrote | ({"ver", "vrm"} if strategy == "band" else set()) <= kinds, kinds
        finally:
            r = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
            assert r.status_code == 204, r.text
    left = await leftovers(store, name)
    assert undocumented(left) == {}
    bans = [f for f in await store.client.hkeys(keys.BANS) if f.startswith(f"{name}/")]
    assert bans == []


@pytest.mark.parametrize(("source", "target"), [("hash", "hash"), ("hash", "band"), ("band", "hash")])
async def test_a_board_resharded_then_deleted_leaves_only_expiring_markers(
    store: BoardStore, source: str, target: str
) -> None:
    """The old layout dropped after the move, the new one with its copies, then the deletion."""
    name = board_name(f"keys-rs-{source}-{target}")
    body = {
        "mode": "incr",
        "periods": ["daily", "weekly"],
        "durability": "memory",
        "sharding": SHARDINGS[source],
        "inactive_after": 86_400,
    }
    board, _ = await store.create(BoardConfig.from_dict(name, body))
    now = times.now_ms()
    await board.submit([Score(f"p{i}", 5 + 9 * i, f"m{i}", now - 1000 * i) for i in range(40)])
    await board.submit([Score(f"q{i}", 5 + 9 * i, f"n{i}", None) for i in range(10)])
    await moderation.remove(board, ["p3", "q4"])
    mover = Resharder(store, name, say=lambda _: None, cache_s=0)
    await mover.start(2, [0, 100, 300] if target == "band" else None)
    assert (await mover.run())["state"] == "none"
    moved = await store.get(name)
    await moved.submit([Score("p3", 7, "again", now)])
    await moderation.remove(moved, ["p5"])
    await store.delete(name)
    left = await leftovers(store, name)
    # The old layout's moved markers and the fences stay a day as well.
    assert {k: t for k, t in undocumented(left).items() if t <= 0 or not k.endswith(":mv")} == {}


@pytest.mark.parametrize("strategy", sorted(SHARDINGS))
async def test_a_season_archive_leaves_only_expiring_markers(
    cluster_url: str, postgres_url: str, store: BoardStore, raw: Any, strategy: str
) -> None:
    """archive_season closes the board (its `frozen:total` markers, which never expire), settles
    it, and deletes it: nothing of it stays that does not expire."""
    name = board_name(f"keys-season-{strategy}")
    body = {"mode": "incr", "periods": ["daily"], "sharding": SHARDINGS[strategy], "inactive_after": 86_400}
    board, _ = await store.create(BoardConfig.from_dict(name, body))
    now = times.now_ms()
    regions = board.layout.sharding.regions
    await board.submit(
        [Score(f"p{i}", 5 + i, f"m{i}", now - 60_000, regions[i % 2] if regions else None) for i in range(20)]
    )
    await moderation.remove(board, ["p3"])
    await drain(raw, store, postgres_url)
    rewards = [{"rank": 1, "reward": "x"}]
    request = settlement.Request.of({"settlement_id": f"{name}-season", "rewards": rewards})
    result = await settlement.archive_season(cluster_url, postgres_url, name, request)
    assert result["archived"] is True
    assert undocumented(await leftovers(store, name)) == {}
