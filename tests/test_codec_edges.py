"""The score codec's boundaries end to end: through the router (JSON and MessagePack) onto the real
cluster, every read compared with the reference model.

Each board takes the largest ``points_max`` its resolution allows and an epoch set so that the
last time its codec can hold is about now: points 0 and ``points_max``, times at the epoch and at
the last representable unit, equal scores on different shards, fractional seconds. One unit past
either end, or one point past ``points_max``, is a 4xx naming the field, and writes nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import zlib
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import httpx
import msgpack
import pytest

from shardlb import periods, times
from shardlb.board import Score
from shardlb.cluster import LocalCluster
from shardlb.codec import RESOLUTION_MS, ScoreCodec
from shardlb.config import BoardConfig
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running

pytestmark = pytest.mark.cluster

SHARDS = 3
MSGPACK = "application/msgpack"
# The largest points_max each resolution allows (the codec keeps at least 30 days of time).
LARGEST = {"s": 2**31 - 1, "ms": 2**21 - 1}


@pytest.fixture(scope="module")
async def client(cluster: LocalCluster) -> AsyncIterator[httpx.AsyncClient]:
    async with running(cluster.url, top_refresh_s=0.2, histogram_refresh_s=0.2) as (_, c):
        yield c


def on_shards(count: int, per_shard: int = 1) -> list[str]:
    """Player ids spread over the hash shards: ``per_shard`` on each of the first ``count`` shards."""
    found: dict[int, list[str]] = {}
    for n in itertools.count():
        player = f"p{n}"
        shard = zlib.crc32(player.encode()) % SHARDS
        if len(found.setdefault(shard, [])) < per_shard:
            found[shard].append(player)
        if sum(len(v) for v in found.values()) == count * per_shard and len(found) >= count:
            return [p for s in sorted(found)[:count] for p in found[s]]
    raise AssertionError("unreachable")


async def post(
    client: httpx.AsyncClient, name: str, scores: list[dict[str, Any]], packed: bool
) -> httpx.Response:
    url = f"/v1/boards/{name}/scores"
    if packed:
        body = msgpack.packb({"scores": scores}, use_bin_type=True)
        return await client.post(
            url, content=body, headers={**AS_WRITER, "Content-Type": MSGPACK, "Accept": MSGPACK}
        )
    return await client.post(url, json={"scores": scores}, headers=AS_WRITER)


async def check_reads(client: httpx.AsyncClient, name: str, ref: ReferenceBoard, since: int) -> None:
    """Every read of the total, both rank modes, equals the reference (``since``: the last write, ms)."""
    codec = ref.codec
    order = ref.order()
    competition = ref.competition()
    expected = {
        "unique": [
            {
                "rank": i + 1,
                "player_id": p,
                "points": pts,
                "achieved_at": times.format_ms(codec.units_to_ms(u)),
            }
            for i, (_, p, pts, u) in enumerate(order)
        ]
    }
    expected["competition"] = [{**e, "rank": competition[e["player_id"]][0]} for e in expected["unique"]]
    for mode, rows in expected.items():
        # The top comes from the router's cache: asked again until it was read after the writes.
        for _ in range(50):
            top = await client.get(f"/v1/boards/{name}/top?limit=1000&rank_mode={mode}")
            assert top.status_code == 200, top.text
            if times.parse(top.json()["as_of"], "as_of") > since:
                break
            await asyncio.sleep(0.05)
        assert top.json()["entries"] == rows, mode
        for offset in range(len(rows)):
            page = await client.get(f"/v1/boards/{name}/entries?offset={offset}&limit=3&rank_mode={mode}")
            assert page.json()["entries"] == rows[offset : offset + 3], (mode, offset)
        for i, row in enumerate(rows):
            me = await client.get(f"/v1/boards/{name}/players/{row['player_id']}?rank_mode={mode}")
            got = me.json()
            assert (got["rank"], got["points"], got["achieved_at"]) == (
                row["rank"],
                row["points"],
                row["achieved_at"],
            ), (mode, row)
            n = len(rows)
            below = n - row["rank"] if mode == "unique" else competition[row["player_id"]][1]
            assert (got["players"], got["percentile"]) == (n, pytest.approx(100 * below / n)), (mode, row)
            for _ in range(50):  # the histograms are refreshed in the background: one read after the writes
                guess = await client.get(
                    f"/v1/boards/{name}/players/{row['player_id']}?estimate=true&rank_mode={mode}"
                )
                est = guess.json()
                if times.parse(est["as_of"], "as_of") > since:
                    break
                await asyncio.sleep(0.05)
            assert (est["points"], est["achieved_at"]) == (row["points"], row["achieved_at"]), (mode, row)
            assert abs(est["rank"] - row["rank"]) <= est["rank_error"], (mode, row, est)
            near = await client.get(
                f"/v1/boards/{name}/players/{row['player_id']}/around?radius=2&rank_mode={mode}"
            )
            assert near.json()["entries"] == rows[max(0, i - 2) : i + 3], (mode, row)
        ids = [row["player_id"] for row in rows][::-1]
        queried = await client.post(
            f"/v1/boards/{name}/players:query?rank_mode={mode}", json={"player_ids": ids}
        )
        assert queried.json()["entries"] == rows, mode


@pytest.mark.parametrize(
    ("order", "tiebreak", "resolution"),
    list(itertools.product(("desc", "asc"), ("earliest", "latest"), ("s", "ms"))),
)
@pytest.mark.parametrize("strategy", ["hash", "band"])
async def test_a_board_at_its_largest_points_and_last_time_reads_as_the_reference(
    client: httpx.AsyncClient, order: str, tiebreak: str, resolution: str, strategy: str
) -> None:
    points_max = LARGEST[resolution]
    sharding: dict[str, Any] = {"strategy": "hash", "shards": SHARDS}
    if strategy == "band":  # the ends of the points range are the ends of the first and last bands
        sharding = {"strategy": "band", "bands": [0, 1, points_max // 2, points_max], "shards": SHARDS}
    unit = RESOLUTION_MS[resolution]
    time_max = ScoreCodec(points_max, order, tiebreak, resolution).time_max
    now = times.now_ms()
    # The last representable unit starts a minute from now (within the 5 minutes a time may be ahead);
    # at resolution s the epoch is off a whole second, so whole seconds from it are not whole seconds.
    epoch = now - time_max * unit + 60_000 - (100 if resolution == "s" else 0)
    settings = {
        "order": order,
        "tiebreak": tiebreak,
        "resolution": resolution,
        "points_max": points_max,
        "epoch": epoch,
        "sharding": sharding,
    }
    name = board_name("edge")
    created = await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)
    assert created.status_code == 201, created.text
    config = BoardConfig.from_dict(name, settings)
    ref = ReferenceBoard(config)
    codec = config.codec()
    last = codec.last_ms
    assert codec.time_units(last) == time_max
    tied = on_shards(SHARDS, 2)  # two players on each shard
    mid = epoch + 40 * 86_400_000 + 1_500  # a fraction of a second past a unit (at s)
    plan = [
        (tied[0], 0, epoch),
        (tied[1], points_max, epoch),
        (tied[2], points_max, last),
        (tied[3], 0, last),
        (tied[4], points_max, epoch),  # equal to tied[1]'s on another shard
        (tied[5], 0, last),  # equal to tied[3]'s on another shard
        ("q0", points_max - 1, mid),
        ("q1", points_max - 1, mid + unit - 1),  # the same unit as q0's
        ("q2", 1, mid),
        ("q3", points_max // 2, epoch + unit),
    ]
    scores = []
    for i, (player, points, at) in enumerate(plan):
        # Every other score as a float with an integral value, or its time as RFC 3339.
        sent_points: Any = float(points) if i % 2 and points < 2**53 else points
        sent_at: Any = times.format_ms(at) if i % 3 == 0 else at
        scores.append(
            {"player_id": player, "points": sent_points, "match_id": f"m{i}", "achieved_at": sent_at}
        )
    for packed, part in ((False, scores[:5]), (True, scores[5:])):
        r = await post(client, name, part, packed)
        assert r.status_code == 200, r.text
    statuses = ref.submit([Score(p, pts, f"m{i}", at) for i, (p, pts, at) in enumerate(plan)], now)
    assert all(s == "improved" for s, _ in statuses)
    await check_reads(client, name, ref, times.now_ms())

    # One past each end: a clear 4xx naming the field, and nothing written.
    refused = [
        ({"player_id": "x", "points": points_max + 1, "match_id": "z", "achieved_at": epoch}, "points"),
        ({"player_id": "x", "points": -1, "match_id": "z", "achieved_at": epoch}, "points"),
        ({"player_id": "x", "points": 1, "match_id": "z", "achieved_at": last + 1}, "achieved_at"),
        ({"player_id": "x", "points": 1, "match_id": "z", "achieved_at": epoch - 1}, "achieved_at"),
        (
            {"player_id": "x", "points": 1, "match_id": "z", "achieved_at": times.format_ms(last + 1)},
            "achieved_at",
        ),
        ({"player_id": "x", "points": 0.5, "match_id": "z", "achieved_at": epoch}, "points"),
    ]
    for packed in (False, True):
        for item, field in refused:
            r = await post(client, name, [scores[0], item], packed)
            assert 400 <= r.status_code < 500, (item, r.text)
            err = (msgpack.unpackb(r.content) if r.headers["content-type"] == MSGPACK else r.json())["error"]
            assert err["field"] == f"scores[1].{field}", (item, err)
    await check_reads(client, name, ref, times.now_ms())


@pytest.mark.parametrize(("mode", "order"), list(itertools.product(("incr", "set", "best"), ("desc", "asc"))))
async def test_sums_past_points_max_and_scores_going_down_answer_as_the_reference(
    client: httpx.AsyncClient, mode: str, order: str
) -> None:
    points_max = LARGEST["s"]
    now = times.now_ms()
    settings = {
        "mode": mode,
        "order": order,
        "tiebreak": "latest" if order == "asc" else "earliest",
        "points_max": points_max,
        "epoch": now - 86_400_000,
        "sharding": {"strategy": "hash", "shards": SHARDS},
    }
    name = board_name("sums")
    created = await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)
    assert created.status_code == 201, created.text
    ref = ReferenceBoard(BoardConfig.from_dict(name, settings))
    a, b, c = on_shards(SHARDS)
    t = now - 60_000
    rounds = [
        [(a, points_max - 5, t), (b, points_max, t), (c, 0, t)],
        [(a, 5, t + 1000), (b, 1, t + 1000), (c, points_max, t)],  # a reaches points_max, b passes it
        [(a, 1, t + 2000), (b, 0, t + 2000), (c, 0, t + 3000)],  # a passes it; set boards go down
        [(a, points_max, t + 4000), (b, points_max - 1, t + 4000), (c, 7, t + 2000)],
        [(a, 0, t + 5000), (b, 0, t + 5000), (c, 0, t + 5000)],  # equal scores on three shards
    ]
    for n, batch in enumerate(rounds):
        scores = [Score(p, pts, f"r{n}-{p}", at) for p, pts, at in batch]
        sent = [
            {
                "player_id": s.player_id,
                "points": s.points,
                "match_id": s.match_id,
                "achieved_at": s.achieved_ms,
            }
            for s in scores
        ]
        r = await post(client, name, sent, packed=bool(n % 2))
        assert r.status_code == 200, r.text
        body = msgpack.unpackb(r.content) if n % 2 else r.json()
        got = [(x["status"], x["points"]) for x in body["results"]]
        assert got == ref.submit(scores, now), n
        await check_reads(client, name, ref, times.now_ms())


async def test_a_new_board_whose_codec_holds_no_time_from_now_on_is_refused(
    client: httpx.AsyncClient,
) -> None:
    """With the default epoch (2020-01-01), resolution "ms" leaves the default points_max about 50
    days of time, and the largest points_max at "s" about 48: every time such a board could hold is
    past, so every write to it would be refused. Creating one is refused instead (422 naming the
    epoch); a board that exists and has run out of time is still confirmed by its settings."""
    for settings in ({"resolution": "ms"}, {"points_max": LARGEST["s"]}, {"points_max": 2**26 - 1}):
        name = board_name("dead")
        r = await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)
        assert r.status_code == 422, (settings, r.text)
        assert (r.json()["error"]["code"], r.json()["error"]["field"]) == ("out_of_range", "epoch")
        assert (await client.get(f"/v1/boards/{name}")).status_code == 404
    # Its last unit 3 s from now: created, written to, and still confirmed once it has passed. (A
    # loaded machine may take a second to create it and write: the write must come before the end.)
    time_max = ScoreCodec(LARGEST["ms"], resolution="ms").time_max
    ends_ms = times.now_ms() + 3000
    settings = {"resolution": "ms", "epoch": ends_ms - time_max}
    name = board_name("ends")
    assert (await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)).status_code == 201
    assert (
        await post(client, name, [{"player_id": "a", "points": 1, "match_id": "m"}], False)
    ).status_code == 200
    await asyncio.sleep(max(0, ends_ms - times.now_ms()) / 1000 + 0.2)
    assert (await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)).status_code == 200
    refused = await post(client, name, [{"player_id": "a", "points": 2, "match_id": "n"}], False)
    assert (refused.status_code, refused.json()["error"]["field"]) == (422, "scores[0].achieved_at")
    again = await client.put(f"/v1/boards/{board_name('ends')}", json=settings, headers=AS_ADMIN)
    assert again.status_code == 422, again.text


@pytest.mark.parametrize(("zone", "week_start"), [("Asia/Kolkata", "sunday"), ("America/St_Johns", "monday")])
async def test_results_around_local_midnight_go_to_the_reference_periods(
    store: BoardStore, zone: str, week_start: str
) -> None:
    """Results a unit either side of the last two local midnights (zones off whole hours) are filed
    in the periods the reference names for their kept time, and each period reads as the reference."""
    settings = {
        "periods": ["daily", "weekly", "monthly"],
        "timezone": zone,
        "week_start": week_start,
        "resolution": "ms",
        "epoch": times.now_ms() - 20 * 86_400_000,
        "close_grace": 7 * 86_400,
        "sharding": {"strategy": "hash", "shards": SHARDS},
    }
    config = BoardConfig.from_dict(board_name("midnight"), settings)
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    today = periods.local_day(now, board.tz)
    scores = []
    for back in (0, 1):
        midnight = periods.start_ms(periods.name_for("daily", today - timedelta(days=back)), board.tz)
        for n, at in enumerate((midnight - 1, midnight, midnight + 1)):
            scores.append(Score(f"p{back}{n}", 10 * n + back, f"m{back}{n}", at))
    try:
        got = await board.submit(scores, now_ms=now)
        assert [(r.status, r.points) for r in got] == ref.submit(scores, now)
        for name in sorted(
            {
                n
                for s in scores
                for n in periods.names_at(s.achieved_ms or 0, config.periods, board.tz, week_start)
            }
        ):
            want = [(p, pts, config.codec().units_to_ms(u)) for _, p, pts, u in ref.order(name)]
            view = board.resolve(periods.api_name(name), now_ms=now)
            assert [(e.player_id, e.points, e.achieved_ms) for e in await board.top(100, view)] == want, name
    finally:
        await store.delete(config.id)
