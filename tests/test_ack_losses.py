"""Confirmations that a failover's loss must not pass: a write confirmed on a replica by a WAIT sent
after it, as a call of its own, was confirmed on the replica promoted if the primary failed in
between, although the write was lost with it. Each test loses the write's effect on the primary
right before the confirming call (``losing``: the state the promoted replica would have) and
checks that the write is either there once answered, or reported NotAcknowledged and converges
when made again."""

from __future__ import annotations

import os
import random
from collections.abc import Awaitable, Callable, Sequence
from types import ModuleType
from typing import Any

import orjson
import pytest
import redis.exceptions

from shardlb import fanout, keys, moderation, reshard_copy, times
from shardlb import store as store_module
from shardlb.archive import connect_db
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.errors import ClusterUnavailable, NotAcknowledged
from shardlb.fanout import Ack, confirmed
from shardlb.rebuild import Rebuilder
from shardlb.reshard import Resharder
from shardlb.reshard_copy import Replicated
from shardlb.store import BoardStore
from tests.test_board import HOUR
from tests.test_rebuild import archiver, drain

pytestmark = pytest.mark.cluster

ACK_MS = 2000


def losing(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType, key: str, undo: Callable[[], Awaitable[Any]]
) -> list[bool]:
    """Make ``module``'s first fanout.confirmed call that names ``key`` run ``undo`` first (the
    failover's loss, on the primary); the list returned holds True once it ran."""
    ran: list[bool] = []

    async def first_losing(
        client: Any, ack: Ack, commands: Sequence[tuple[Any, ...]], **how: Any
    ) -> list[Any]:
        named = {str(c[3] if c[0] in ("EVAL", "EVALSHA") else c[1]) for c in commands}
        if not ran and key in named:
            await undo()
            ran.append(True)
        return await confirmed(client, ack, commands, **how)

    monkeypatch.setattr(module, "confirmed", first_losing)
    return ran


async def test_a_ban_or_lift_lost_before_its_confirmation_is_never_answered(
    store: BoardStore, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Bans._confirm`` sent its marker and WAIT after the ban's HSET, as a call of its own: a
    failover in between confirmed the ban on the replica promoted, which never had it, and the ban
    was answered while routers went on taking the player's results."""
    client = store.client
    bans = moderation.Bans(client, Ack(1, ACK_MS))
    player = f"lost-ban-{os.getpid()}-{random.randrange(10**9)}"
    ban = moderation.Ban(player, moderation.ALL, "bot", "test", times.now_ms())
    field = moderation.ban_field(ban.board, player)
    db = await connect_db(postgres_url)
    try:
        ran = losing(monkeypatch, moderation, keys.BANS, lambda: client.hdel(keys.BANS, field))
        try:
            await bans.add(db, ban, f"ban-{player}")
        except NotAcknowledged:
            pass  # reported: the retry below makes it again
        else:
            assert await client.hget(keys.BANS, field) is not None, "a lost ban was answered"
        assert ran
        monkeypatch.undo()
        assert await bans.add(db, ban, f"ban-{player}") == (ban, True)
        assert await client.hget(keys.BANS, field) is not None
        record = await client.hget(keys.BANS, field)
        ran = losing(monkeypatch, moderation, keys.BANS, lambda: client.hset(keys.BANS, field, record))
        try:
            await bans.lift(db, player, ban.board, "test", "done", f"unban-{player}")
        except NotAcknowledged:
            pass
        else:
            assert await client.hget(keys.BANS, field) is None, "a lost lift was answered"
        assert ran
        monkeypatch.undo()
        await bans.lift(db, player, ban.board, "test", "done", f"unban-{player}")
        assert await client.hget(keys.BANS, field) is None
    finally:
        monkeypatch.undo()
        await bans.lift(db, player, ban.board, "test", "cleanup", None)
        await db.close()


async def test_a_reshard_record_lost_before_its_confirmation_is_never_gone_on_from(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Copier.confirm`` sent its marker and WAIT after the mover's compare-and-set of the record:
    a failover in between confirmed the record on the replica promoted, which never had it, and
    the mover went on from a step the registry no longer held (a commit lost after the new layout
    took writes led a resume to drop that layout)."""
    board_id = f"lost-rec-{os.getpid()}-{random.randrange(10**9)}"
    body = {"mode": "incr", "durability": "memory", "sharding": {"strategy": "hash", "shards": 1}}
    await store.create(BoardConfig.from_dict(board_id, body))
    client = store.client
    try:
        before = await client.hget(keys.BOARDS, board_id)
        mover = Resharder(store, board_id, say=lambda _: None)
        ran = losing(
            monkeypatch, reshard_copy, keys.BOARDS, lambda: client.hset(keys.BOARDS, board_id, before)
        )
        try:
            await mover._update(lambda r: {**r, "probe": 1})
        except NotAcknowledged:
            pass
        else:
            raw = await client.hget(keys.BOARDS, board_id)
            assert orjson.loads(raw).get("probe") == 1, "a lost record was gone on from"
        assert ran
        monkeypatch.undo()
        await mover._update(lambda r: {**r, "probe": 2})
        assert orjson.loads(await client.hget(keys.BOARDS, board_id)).get("probe") == 2
    finally:
        monkeypatch.undo()
        await client.hset(keys.BOARDS, board_id, before)  # no "probe": a setting the board lacks
        await store.delete(board_id)


async def test_a_board_created_or_deleted_and_lost_before_its_confirmation_is_never_answered(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``BoardStore._confirm`` sent its marker and WAIT after the registry's write, as a call of its
    own: a failover in between confirmed on the replica promoted a creation it never had (a 201 for
    a board then gone, with every score acknowledged on it), or a deletion it never had (a 204 for a
    board still there)."""
    client = store.client
    acked = BoardStore(client, store.scripts)
    acked.ack = Ack(1, ACK_MS)
    board_id = f"lost-board-{os.getpid()}-{random.randrange(10**9)}"
    config = BoardConfig.from_dict(board_id, {"mode": "incr", "sharding": {"shards": 1}})
    try:
        ran = losing(monkeypatch, store_module, keys.BOARDS, lambda: client.hdel(keys.BOARDS, board_id))
        try:
            await acked.create(config)
        except NotAcknowledged:
            pass
        else:
            assert await client.hget(keys.BOARDS, board_id) is not None, "a lost board was answered"
        assert ran
        monkeypatch.undo()
        board, _ = await acked.create(config)
        raw = await client.hget(keys.BOARDS, board_id)
        assert raw is not None and orjson.loads(raw)["incarnation"] == board.incarnation
        ran = losing(monkeypatch, store_module, keys.BOARDS, lambda: client.hset(keys.BOARDS, board_id, raw))
        try:
            await acked.delete(board_id)
        except NotAcknowledged:
            pass
        else:
            assert await client.hget(keys.BOARDS, board_id) is None, "a lost deletion was answered"
        assert ran
        monkeypatch.undo()
        await acked.delete(board_id)
        assert await client.hget(keys.BOARDS, board_id) is None
    finally:
        monkeypatch.undo()
        if await client.hexists(keys.BOARDS, board_id):
            await store.delete(board_id)


async def test_a_boards_sentinels_are_confirmed_before_its_record(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A creation confirmed on a replica the registry's record alone, not its shards' sentinels
    (keys.sentinel_key): a failover of a shard's primary before its replica had the sentinel left
    a board answered 201 whose shard was then taken for lost though it lost nothing (its writes
    refused SHARDLOST, the archiver's mark, until `shardlb rebuild BOARD --shard N`). The sentinels
    are lost here at the creation's first confirmation. Failed before: the board was answered with
    shard 0's sentinel missing (``all([0, 1, 1])``), so its writes there were refused."""
    client = store.client
    acked = BoardStore(client, store.scripts)
    acked.ack = Ack(1, ACK_MS)
    board_id = f"lost-sentinel-{os.getpid()}-{random.randrange(10**9)}"
    config = BoardConfig.from_dict(board_id, {"mode": "best", "sharding": {"shards": 3}})
    incarnation = "5e471e15"
    monkeypatch.setattr(store_module.secrets, "token_hex", lambda _: incarnation)
    names = [keys.sentinel_key(p) for p in acked.layout(config, incarnation, 0).prefixes]
    ran: list[bool] = []

    async def first_losing(
        client_: Any, ack: Ack, commands: Sequence[tuple[Any, ...]], **how: Any
    ) -> list[Any]:
        if not ran:
            await client.delete(names[0])  # shard 0's primary failed over before its replica had it
            ran.append(True)
        return await confirmed(client_, ack, commands, **how)

    monkeypatch.setattr(store_module, "confirmed", first_losing)
    try:
        try:
            board, _ = await acked.create(config)
        except NotAcknowledged:
            monkeypatch.undo()
            board, _ = await acked.create(config)
        assert ran
        monkeypatch.undo()
        assert board.sentinels and all([await client.exists(n) for n in names])
        scores = [Score(f"p{i}", 10, f"m{i}", times.now_ms()) for i in range(30)]
        assert {board.layout.home(s.player_id) for s in scores} == {0, 1, 2}
        assert len(await board.submit(scores)) == 30
        # A creation whose sentinels no replica confirms leaves none behind (no record names them).
        await store.delete(board_id)
        monkeypatch.setattr(store_module.secrets, "token_hex", lambda _: incarnation)

        async def unconfirmed(
            client_: Any, ack: Ack, commands: Sequence[tuple[Any, ...]], **how: Any
        ) -> list[Any]:
            return [NotAcknowledged("no replica confirmed it") for _ in commands]

        monkeypatch.setattr(store_module, "confirmed", unconfirmed)
        with pytest.raises(NotAcknowledged):
            await acked.create(config)
        assert not any([await client.exists(n) for n in names])
        assert not await client.hexists(keys.BOARDS, board_id)
    finally:
        monkeypatch.undo()
        if await client.hexists(keys.BOARDS, board_id):
            await store.delete(board_id)


async def test_a_reshards_new_sentinels_are_confirmed_before_its_commit(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mover wrote the new layout's sentinels (keys.sentinel_key) with plain SETs, while every
    copy it makes is confirmed on a replica: a failover of a new shard's primary before its
    replica had the sentinel left the board committed with that shard taken for lost though it
    lost nothing. The sentinel is lost here at the first confirmation the mover makes once it was
    written, unless that confirmation is its own. Failed before: shard 0 of the new layout was
    committed without its sentinel (``all([0, 1, 1, 1, 1])``)."""
    board_id = f"lost-here-{os.getpid()}-{random.randrange(10**9)}"
    body = {"mode": "best", "durability": "memory", "sharding": {"strategy": "hash", "shards": 2}}
    board, _ = await store.create(BoardConfig.from_dict(board_id, body))
    client = store.client
    names: list[str] = []  # the new layout's sentinels
    ran: list[bool] = []

    async def first_losing(
        client_: Any, ack: Ack, commands: Sequence[tuple[Any, ...]], **how: Any
    ) -> list[Any]:
        if not ran:
            if any(names[0] in map(str, c) for c in commands):
                ran.append(True)  # its own confirmation: a loss before it is seen there
            elif await client.exists(names[0]):
                await client.delete(names[0])  # its primary failed over before its replica had it
                ran.append(True)
        return await confirmed(client_, ack, commands, **how)

    try:
        await board.submit([Score(f"p{i}", 10 + i, f"m{i}", times.now_ms()) for i in range(20)])
        mover = Resharder(store, board_id, say=lambda _: None, cache_s=0)
        _, target = mover._layouts(await mover.start(5))
        names += [keys.sentinel_key(p) for p in target.prefixes]
        monkeypatch.setattr(reshard_copy, "confirmed", first_losing)
        try:
            await mover.run()
        except NotAcknowledged:
            monkeypatch.undo()
            await Resharder(store, board_id, say=lambda _: None, cache_s=0).run()
        assert ran
        monkeypatch.undo()
        back = await store.get(board_id)
        assert back.generation == 1 and all([await client.exists(n) for n in names])
    finally:
        monkeypatch.undo()
        await store.delete(board_id)


async def test_a_movers_fences_are_confirmed_before_a_stalled_mover_can_write_again(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mover that takes a reshard over writes its epoch into every shard's fence, so that the
    mover it took over from, stalled between a read and its write, is refused there
    (tests/test_reshard_fencing.py). Those fence writes were plain: a failover of a shard's
    primary before its replica had the new fence left the older epoch there, and the stalled
    mover's write landed in the new layout as if it still held the reshard. The fence is lost here
    at the first confirmation made once it was written, unless that confirmation is its own.
    Failed before: DID NOT RAISE Lost, the stalled mover's stale copy written."""
    board_id = f"lost-fence-{os.getpid()}-{random.randrange(10**9)}"
    body = {"mode": "best", "durability": "memory", "sharding": {"strategy": "hash", "shards": 2}}
    board, _ = await store.create(BoardConfig.from_dict(board_id, body))
    client = store.client
    ran: list[bool] = []
    try:
        await board.submit([Score(f"p{i}", 10 + i, f"m{i}", times.now_ms()) for i in range(20)])
        stale = Resharder(store, board_id, say=lambda _: None, cache_s=0)
        _, target = stale._layouts(await stale.start(3))
        stale.incarnation = board.incarnation
        await stale._take()  # then it stalls, past its lease
        fence = reshard_copy.fence_key(target.prefixes[0])
        before = await client.get(fence)

        async def first_losing(
            client_: Any, ack: Ack, commands: Sequence[tuple[Any, ...]], **how: Any
        ) -> list[Any]:
            if not ran:
                if any(c[1] == reshard_copy.FENCE and str(c[3]) == fence for c in commands):
                    ran.append(True)  # its own confirmation: a loss before it is seen there
                elif await client.get(fence) not in (None, before):
                    await client.set(fence, before, px=reshard_copy.FENCE_MS)  # the replica's, promoted
                    ran.append(True)
            return await confirmed(client_, ack, commands, **how)

        monkeypatch.setattr(reshard_copy, "confirmed", first_losing)
        taker = Resharder(store, board_id, say=lambda _: None, cache_s=0)
        taker.incarnation = board.incarnation
        await taker._take()
        total = keys.period_key(target.prefixes[0], "total")
        late = reshard_copy.Writes()
        late.add(target.prefixes[0], "ZADD", total, 1, "p0")
        with pytest.raises(reshard_copy.Lost):
            await stale.copier.send(late)
        assert ran
        assert not await client.exists(total)
    finally:
        monkeypatch.undo()
        await store.delete(board_id)


@pytest.mark.parametrize("mode", ["best", "incr"])
async def test_a_forced_swaps_apply_lost_in_a_failover_is_never_said_done(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    postgres_url: str,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
) -> None:
    """A rebuild that waits for replicas (``confirming``: `rebuild --all` after ``restore``) puts
    the results written between its snapshot and a forced swap onto the live keys after the swap
    (``_apply_live``), then confirmed them with ``_confirm_shard``: an EXISTS with the marker and
    WAIT, a call of its own. A failover in between had the replica promoted (the swap, not the
    apply) confirm it, and the rebuild said done with those results missing and a player removed
    meanwhile back. Here the primary "fails" right after the first round that carries a WAIT once
    the apply began: that round's connection breaks, and the apply's effect is gone."""
    config = BoardConfig.from_dict(
        f"lost-apply-{mode}-{random.randrange(10**9)}", {"mode": mode, "sharding": {"shards": 1}}
    )
    board, _ = await store.create(config)
    prefix = board.prefixes[0]
    a = await archiver(raw, store, postgres_url)
    try:
        now = times.now_ms()
        scores = [Score(f"p{i}", 10 * i, f"m{i}", now - HOUR) for i in range(1, 4)]
        await board.submit([*scores, Score("cheater", 5, "early", now - HOUR)], now_ms=now - HOUR)
        await drain(a)
        rebuilder.swap_tries = 0  # the first swap is forced
        rebuilder.confirming = Replicated(raw)
        rebuilder.replica_wait_ms = ACK_MS
        real_snapshot, real_apply, real_pipelines = (
            rebuilder.snapshot,
            rebuilder._apply_live,
            fanout._pipelines,
        )
        before: dict[Any, Any] = {}
        lost: list[bool] = []

        async def snapshot(*args: Any, **kwargs: Any) -> Any:
            snap = await real_snapshot(*args, **kwargs)
            await board.submit([Score("p1", 100, "between", now)], now_ms=now)  # before the swap
            assert await moderation.remove(board, ["cheater"]) == {"cheater"}
            return snap

        async def apply_live(*args: Any, **kwargs: Any) -> int:
            names = [keys.index_key(prefix), *await raw.zrange(keys.index_key(prefix), 0, -1)]
            before.update({name: await raw.dump(name) for name in names})  # as the swap left them
            return await real_apply(*args, **kwargs)

        async def pipelines(sends: Any, timeout: Any) -> Any:
            out = await real_pipelines(sends, timeout)
            carries_wait = any(c.args[0] == "WAIT" for _, commands in sends for c in commands)
            if before and not lost and carries_wait:  # the failover: the apply lost, the link broken
                lost.append(True)
                for name, dumped in before.items():
                    await raw.delete(name)
                    if dumped is not None:
                        await raw.restore(name, 0, dumped)
                return [redis.exceptions.ConnectionError("the primary failed")] * len(sends)
            return out

        monkeypatch.setattr(rebuilder, "snapshot", snapshot)
        monkeypatch.setattr(rebuilder, "_apply_live", apply_live)
        monkeypatch.setattr(fanout, "_pipelines", pipelines)
        p1 = 100 if mode == "best" else 110
        complete = [("p1", p1), ("p3", 30), ("p2", 20)]
        try:
            await rebuilder.rebuild(board)
        except NotAcknowledged:
            pass  # reported: run again below
        else:
            top = await board.top(10, board.resolve("total"))
            assert [(e.player_id, e.points) for e in top] == complete, "a lost apply was said done"
        assert lost
        monkeypatch.undo()
        await drain(a)
        again = Rebuilder(raw, rebuilder.script, rebuilder.db)
        again.confirming = Replicated(raw)
        await again.rebuild(board)
        top = await board.top(10, board.resolve("total"))
        assert [(e.player_id, e.points) for e in top] == complete
    finally:
        monkeypatch.undo()
        await a.db.close()
        await store.delete(config.id)


async def shard_keys(raw: Any, prefix: str) -> dict[bytes, tuple[bytes, int]]:
    """Every key of a shard (its prefix), dumped with its TTL (ms, 0 for none): the state a replica
    promoted would hold."""
    return {name: (await raw.dump(name), max(await raw.pttl(name), 0)) for name in await named(raw, prefix)}


async def named(raw: Any, prefix: str) -> list[bytes]:
    """The names of a shard's keys (KEYS on its primary: the cluster client asks a random node)."""
    return list(await raw.keys(prefix + "*", target_nodes=raw.get_node_from_key(prefix)))


async def put_back(raw: Any, prefix: str, state: dict[bytes, tuple[bytes, int]]) -> None:
    """The shard's keys as ``state`` holds them: the others deleted, each of them restored."""
    for name in await named(raw, prefix):
        await raw.delete(name)
    for name, (dumped, ttl) in state.items():
        await raw.restore(name, ttl, dumped)


async def forced_board(store: BoardStore, raw: Any, postgres_url: str, name: str, mode: str) -> Any:
    """A one-shard board with three players and a cheater, archived; returns (board, archiver)."""
    body = {"mode": mode, "sharding": {"shards": 1}}
    config = BoardConfig.from_dict(f"{name}-{mode}-{random.randrange(10**9)}", body)
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url)
    now = times.now_ms()
    scores = [Score(f"p{i}", 10 * i, f"m{i}", now - HOUR) for i in range(1, 4)]
    await board.submit([*scores, Score("cheater", 5, "early", now - HOUR)], now_ms=now - HOUR)
    await drain(a)
    return board, a


@pytest.mark.parametrize("mode", ["best", "incr"])
async def test_a_one_board_forced_swaps_apply_lost_in_a_failover_is_never_said_done(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    monkeypatch: pytest.MonkeyPatch,
    postgres_url: str,
    mode: str,
) -> None:
    """A rebuild of one board (`shardlb rebuild BOARD`, the admin endpoint, `reconcile --repair`)
    forced its swap and put the results written between its last try and the swap onto the live
    keys in a second call (``_apply_live``), both on the primary alone. The primary failing right
    after the apply, before a replica had it, left the replica promoted with the swap and without
    the apply: those results (acknowledged by a replica, in ``SHARDLB_ACK=replica``) and the removal
    among them were gone, and the rebuild said done. Here the apply's effect is lost right after it
    ran: with a WAIT on its connection that connection breaks, else the reply came back first."""
    board, a = await forced_board(store, raw, postgres_url, "lost-one-apply", mode)
    prefix = board.prefixes[0]
    now = times.now_ms()
    try:
        rebuilder.swap_tries = 0  # the first swap is forced
        rebuilder.replica_wait_ms = ACK_MS
        real_snapshot, real_apply = rebuilder.snapshot, rebuilder._apply_live
        real_run, real_pipelines = rebuilder.script.run, fanout._pipelines
        before: dict[bytes, tuple[bytes, int]] = {}
        lost: list[bool] = []

        async def snapshot(*args: Any, **kwargs: Any) -> Any:
            snap = await real_snapshot(*args, **kwargs)
            await board.submit([Score("p1", 100, "between", now)], now_ms=now)  # before the swap
            assert await moderation.remove(board, ["cheater"]) == {"cheater"}
            return snap

        async def apply_live(*args: Any, **kwargs: Any) -> int:
            before.update(await shard_keys(raw, prefix))  # as the swap left them
            return await real_apply(*args, **kwargs)

        async def run(numkeys: int, values: list[Any]) -> Any:  # the call without a WAIT
            reply = await real_run(numkeys, values)
            if before and not lost and values[numkeys] == "apply":  # answered, then lost
                lost.append(True)
                await put_back(raw, prefix, before)
            return reply

        async def pipelines(sends: Any, timeout: Any) -> Any:  # the call with a WAIT
            out = await real_pipelines(sends, timeout)
            carries_wait = any(c.args[0] == "WAIT" for _, commands in sends for c in commands)
            if before and not lost and carries_wait:  # the apply lost, the connection broken
                lost.append(True)
                await put_back(raw, prefix, before)
                return [redis.exceptions.ConnectionError("the primary failed")] * len(sends)
            return out

        monkeypatch.setattr(rebuilder, "snapshot", snapshot)
        monkeypatch.setattr(rebuilder, "_apply_live", apply_live)
        monkeypatch.setattr(rebuilder.script, "run", run)
        monkeypatch.setattr(fanout, "_pipelines", pipelines)
        complete = [("p1", 100 if mode == "best" else 110), ("p3", 30), ("p2", 20)]
        try:
            await rebuilder.rebuild(board)
        except NotAcknowledged:
            pass  # reported: run again below
        else:
            top = await board.top(10, board.resolve("total"))
            assert [(e.player_id, e.points) for e in top] == complete, "a lost apply was said done"
        assert lost
        monkeypatch.undo()
        await drain(a)
        again = Rebuilder(raw, rebuilder.script, rebuilder.db)
        await again.rebuild(board)
        top = await board.top(10, board.resolve("total"))
        assert [(e.player_id, e.points) for e in top] == complete
    finally:
        monkeypatch.undo()
        await a.db.close()
        await store.delete(board.config.id)


@pytest.mark.parametrize("mode", ["best", "incr"])
async def test_a_forced_swap_lost_in_a_failover_is_never_applied_to(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    monkeypatch: pytest.MonkeyPatch,
    postgres_url: str,
    mode: str,
) -> None:
    """The other half of a failover between a forced swap and its apply: the swap lost with the
    primary, the apply made on the replica promoted, which holds the board as it was before the
    swap, the results written between the last try and the swap included. The apply added them
    again (an incr board counted their points twice), and the rebuild said done. Now the apply
    finds the swap's marker missing and changes nothing: a clear error, and the rebuild run again
    converges. Here the shard's keys are put back as they were before the swap right before the
    apply (the state of the replica promoted), whatever confirmed the swap."""
    board, a = await forced_board(store, raw, postgres_url, "lost-one-swap", mode)
    prefix = board.prefixes[0]
    now = times.now_ms()
    try:
        rebuilder.swap_tries = 0  # the first swap is forced
        rebuilder.replica_wait_ms = ACK_MS
        real_snapshot, real_apply, real_call = rebuilder.snapshot, rebuilder._apply_live, rebuilder._call
        before: dict[bytes, tuple[bytes, int]] = {}
        lost: list[bool] = []

        async def snapshot(*args: Any, **kwargs: Any) -> Any:
            snap = await real_snapshot(*args, **kwargs)
            await board.submit([Score("p1", 100, "between", now)], now_ms=now)  # before the swap
            assert await moderation.remove(board, ["cheater"]) == {"cheater"}
            return snap

        async def call(*args: Any, **kwargs: Any) -> Any:
            if args[2] == "swap" and not before:
                before.update(await shard_keys(raw, prefix))  # the board before the swap
            return await real_call(*args, **kwargs)

        async def apply_live(*args: Any, **kwargs: Any) -> int:
            lost.append(True)
            await put_back(raw, prefix, before)  # the swap lost with the primary
            return await real_apply(*args, **kwargs)

        monkeypatch.setattr(rebuilder, "snapshot", snapshot)
        monkeypatch.setattr(rebuilder, "_call", call)
        monkeypatch.setattr(rebuilder, "_apply_live", apply_live)
        complete = [("p1", 100 if mode == "best" else 110), ("p3", 30), ("p2", 20)]
        refused: list[str] = []
        try:
            await rebuilder.rebuild(board)
        except ClusterUnavailable as e:
            refused.append(str(e))
        assert lost
        top = await board.top(10, board.resolve("total"))
        assert [(e.player_id, e.points) for e in top] == complete, "applied again after the swap was lost"
        assert refused and "swap" in refused[0], "a lost swap was said done"
        monkeypatch.undo()
        await drain(a)
        again = Rebuilder(raw, rebuilder.script, rebuilder.db)
        await again.rebuild(board)
        top = await board.top(10, board.resolve("total"))
        assert [(e.player_id, e.points) for e in top] == complete
    finally:
        monkeypatch.undo()
        await a.db.close()
        await store.delete(board.config.id)
