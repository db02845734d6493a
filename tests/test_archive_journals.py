"""The archiver's reads and trims of its journals (poll.lua, trim.lua, one pipeline per node:
docs/design-notes.md, "An idle archiver"): what a failure of those pipelines leaves, and trim.lua
against the Python trim it replaced, on the suite's cluster and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from shardlb import archive, fanout, keys, times
from shardlb.board import Board, Score
from shardlb.config import BoardConfig
from shardlb.connection import Script, script_source
from shardlb.journal import GROUP
from shardlb.store import BoardStore
from tests.test_archive import archived, archiver, drain, first_pause

pytestmark = pytest.mark.cluster

# Entry ids the trim cases draw from: the usual ones, and ids past 2^53 (write.lua's never are; an
# id given explicitly may be), up to the largest Redis takes.
_MS = [1, 7, 1_765_000_000_000, 2**53 - 1, 2**53 + 1, 2**63 + 5, 2**64 - 1]
_SEQ = [0, 1, 2, 2**53 - 1, 2**53 + 1, 2**54 + 6, 2**54 + 7, 2**64 - 2, 2**64 - 1]


def _order(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@contextlib.asynccontextmanager
async def archived_board(
    store: BoardStore, raw: Any, postgres_url: str, name: str, shards: int, consumer: str
) -> AsyncIterator[tuple[Board, archive.Archiver]]:
    """A hash board of ``shards`` shards and an archiver of its own named ``consumer``: both gone
    after."""
    config = BoardConfig.from_dict(name, {"sharding": {"strategy": "hash", "shards": shards}})
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, consumer)
    try:
        yield board, a
    finally:
        await a.db.close()
        await store.delete(config.id)


async def _consumers(raw: Any, key: str) -> set[str]:
    return {_text(c["name"]) for c in await raw.xinfo_consumers(key, GROUP)}


async def test_a_trim_drops_what_the_python_trim_dropped_whatever_the_ids(raw: Any) -> None:
    """trim.lua against the trim it replaced (shardlb/archive.py before 2026-12-06), on random
    journals: entries before the one after the group's last delivered entry, or before its oldest
    pending one if older, are dropped, the newest of them last (max-deleted-entry-id); nothing else,
    whatever other group reads the journal. Lua's numbers are doubles: computed from ids past 2^53,
    the floor was rounded, up as well as down (and past 2^63 the script failed), and the trim
    deleted an entry not handed out yet. Where the Python trim failed (the last entry handed out
    has the largest sequence: the id after it is none), entries up to that one go."""
    trim = Script(raw, script_source("trim.lua"))
    rng = random.Random("trim.lua")
    key = "{archive-trim-cases}:journal"
    pool = sorted({(ms, seq) for ms in _MS for seq in _SEQ if (ms, seq) != (0, 0)})
    try:
        for case in range(60):
            await raw.delete(key)
            ids = [f"{ms}-{seq}" for ms, seq in sorted(rng.sample(pool, rng.randrange(0, 8)))]
            deleted = "0-0"  # the stream's max-deleted-entry-id before the trim
            if not ids:  # a journal whose entries have all gone: the key stays, empty
                await raw.xadd(key, {"f": "v"}, id="1-1")
                await raw.xdel(key, "1-1")
                deleted = "1-1"
            for i in ids:
                await raw.xadd(key, {"f": i}, id=i)
            if rng.random() < 0.1:  # the key without the archivers' group
                assert await archive.trim(trim, key) is None, case
                assert [_text(i) for i, _ in await raw.xrange(key)] == ids, case
                continue
            await raw.xgroup_create(key, GROUP, id="0")
            await raw.xgroup_create(key, "other", id="0")
            await raw.xreadgroup("other", "o", {key: ">"}, count=rng.randrange(1, 4))
            delivered: list[str] = []
            for consumer in rng.sample(["c1", "c2"], rng.randrange(0, 3)):
                got = await raw.xreadgroup(GROUP, consumer, {key: ">"}, count=rng.randrange(1, 4))
                delivered += [_text(i) for _, items in got or [] for i, _ in items]
            acked = [i for i in delivered if rng.random() < 0.6]
            if acked:
                await raw.xack(key, GROUP, *acked)
            # What the Python trim dropped: ids below the floor, exactly.
            last = _order(delivered[-1]) if delivered else (0, 0)
            floor = (last[0], last[1] + 1)
            pending = [_order(i) for i in delivered if i not in acked]
            if pending:
                floor = min(floor, min(pending))
            kept = [i for i in ids if _order(i) >= floor]
            gone = [i for i in ids if _order(i) < floor]
            cut = await archive.trim(trim, key)
            assert [_text(i) for i, _ in await raw.xrange(key)] == kept, (case, ids, delivered, acked)
            assert cut == (gone[-1] if gone else deleted), (case, ids, delivered, acked)
    finally:
        await raw.delete(key)


async def test_a_trim_keeps_an_entry_not_handed_out_next_to_one_acknowledged(raw: Any) -> None:
    """The case of the test above where a rounded floor lost an entry: 1-(2^54+6) acknowledged,
    1-(2^54+7) never handed out. As a double 2^54+6 and 2^54+7 are both 2^54+8, so the floor came
    out past the entry waiting and the trim deleted it."""
    trim = Script(raw, script_source("trim.lua"))
    key = "{archive-trim-rounded}:journal"
    done, waiting = f"1-{2**54 + 6}", f"1-{2**54 + 7}"
    try:
        await raw.delete(key)
        await raw.xadd(key, {"f": "v"}, id=done)
        await raw.xadd(key, {"f": "v"}, id=waiting)
        await raw.xgroup_create(key, GROUP, id="0")
        await raw.xreadgroup(GROUP, "c1", {key: ">"}, count=1)
        await raw.xack(key, GROUP, done)
        assert await archive.trim(trim, key) == done
        assert [_text(i) for i, _ in await raw.xrange(key)] == [waiting]
    finally:
        await raw.delete(key)


async def test_an_idle_round_forgets_consumers_on_a_node_without_its_scripts(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A promoted replica, or a node started again, has an empty script cache: the round's
    pipelined calls there get NOSCRIPT. Reads and trims are made again alone, which loads their
    script; the forgetting of idle consumers was dropped with its error (and counted as done), so
    where journals stay idle no archiver that ran before was ever forgotten."""
    config = BoardConfig.from_dict("archive-forget-noscript", {"sharding": {"strategy": "hash", "shards": 3}})
    board, _ = await store.create(config)
    before = await archiver(raw, store, postgres_url, "before")
    live = await archiver(raw, store, postgres_url, "live", forget_idle_s=0.3)
    journals = [keys.journal_key(p) for p in board.prefixes]
    try:
        # what other modules left in the registry's journals (CI of 2026-12-06 archived 5,020 here)
        await drain(before)
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i, "m1", now) for i in range(20)], now_ms=now)
        assert await drain(before) == 20
        await asyncio.sleep(0.4)
        await raw.execute_command("SCRIPT FLUSH", target_nodes=raw.PRIMARIES)
        assert await live.round() == 0
        for key in journals:
            assert "before" not in await _consumers(raw, key), key
    finally:
        await before.db.close()
        await live.db.close()
        await store.delete(config.id)


async def test_entries_read_in_a_round_that_failed_are_read_at_the_next(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round's reads hand entries to this archiver (poll.lua's XREADGROUP '>'). When the round
    fails before they are committed (here a node's pipeline lost its replies and the read made
    again alone failed too: a failover), the next round must read its own pending entries first
    ('0'), from every journal: read from '>' they came back only once XAUTOCLAIM took them over,
    ``claim_idle_s`` later (30 s)."""
    async with archived_board(store, raw, postgres_url, "archive-poll-failed", 6, "polled") as (board, a):
        ours = {keys.journal_key(p) for p in board.prefixes}
        await drain(a)  # what other modules left in the registry's journals
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i, "m1", now) for i in range(30)], now_ms=now)
        real = fanout._pipelines

        def reads_ours(queue: Any) -> bool:
            return any(c.args[0] == "EVALSHA" and c.args[3] in ours for c in queue)

        async def lost(sends: Any, timeout: float | None) -> list[Any]:
            outcomes = await real(sends, timeout)  # every call ran
            # A pipeline of other journals only (the registry may hold hundreds, from other
            # modules, and a round sends 500 to a pipeline) keeps its replies.
            first = next((i for i, (_, queue) in enumerate(sends) if reads_ours(queue)), None)
            if first is not None:
                outcomes[first] = RedisConnectionError("the node's replies were lost")
            return outcomes

        async def down(key: str, own_first: bool = False) -> Any:
            raise RedisConnectionError("the node is failing over")

        monkeypatch.setattr(fanout, "_pipelines", lost)
        monkeypatch.setattr(a, "_read", down)
        with pytest.raises(RedisConnectionError):
            await a.round()
        monkeypatch.undo()
        assert await drain(a) == 30
        assert len(await archived(postgres_url, board)) == 30


async def test_an_idle_archivers_pause_does_not_count_its_refresh(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a round that archived nothing the archiver waits as long as that round took. The
    refresh of the board list before it (every 2 s: the registry, a PostgreSQL transaction, now and
    then the sweep of deleted boards' bans) is no round: counted in, a refresh that PostgreSQL held
    up made the archiver wait as long again before it read a journal."""
    a = await archiver(raw, store, postgres_url, "paced-refresh")
    try:
        assert await first_pause(a, monkeypatch, 0.0, refresh_takes_s=0.5, idle_s=0.2, refresh_s=0.0) == 0.2
    finally:
        await a.db.close()


async def test_an_archiver_started_again_under_its_name_reads_its_own_pending_entries_first(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """An archiver killed between its reads and its commit leaves the entries it read pending to its
    name. Started again under that name (a pod's restart keeps it), its first round must read them
    ('0'): read from '>', they waited for XAUTOCLAIM, ``claim_idle_s`` later (30 s), though no other
    archiver holds them."""
    async with archived_board(store, raw, postgres_url, "archive-reborn", 3, "reborn") as (board, first):
        await drain(first)  # what other modules left in the registry's journals
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i, "m1", now) for i in range(12)], now_ms=now)
        ours = [keys.journal_key(p) for p in board.prefixes]
        read = await first._poll(ours)  # the reads of a round whose process then died
        assert sum(len(got) for got, _ in read) == len(ours)  # an entry a shard
        again = await archiver(raw, store, postgres_url, "reborn")
        try:
            assert await drain(again) == 12
            assert len(await archived(postgres_url, board)) == 12
        finally:
            await again.db.close()


async def test_more_pending_entries_than_a_read_takes_are_read_over_the_next_rounds(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A read of this consumer's own pending entries takes ``count`` at most. When it came back full
    the next round reads them again ('0>'), until one comes back short: from '>' the rest waited
    for XAUTOCLAIM, ``claim_idle_s`` (30 s) later."""
    async with archived_board(store, raw, postgres_url, "archive-reborn-many", 1, "many") as (board, first):
        await drain(first)
        (key,) = [keys.journal_key(p) for p in board.prefixes]
        now = times.now_ms()
        for i in range(12):  # an entry each
            await board.submit([Score(f"p{i}", i, f"m{i}", now)], now_ms=now)
        await raw.xgroup_create(key, GROUP, id="0")  # as poll.lua makes it
        handed = await raw.xreadgroup(GROUP, "many", {key: ">"}, count=20)  # a killed archiver's reads
        assert len(handed[0][1]) == 12
        again = await archiver(raw, store, postgres_url, "many", count=5)
        try:
            assert [await again.round() for _ in range(4)] == [5, 5, 2, 0]
            assert len(await archived(postgres_url, board)) == 12
        finally:
            await again.db.close()


async def test_an_idle_archivers_pause_after_a_slow_round_is_bounded(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an idle round the archiver waits as long as that round took, but no longer than
    ``pause_max_s``: one round held up (a failover, a slow node) must not hold the next as long."""
    a = await archiver(raw, store, postgres_url, "paced-slow")
    try:
        assert await first_pause(a, monkeypatch, 0.3, idle_s=0.05, pause_max_s=0.1) == 0.1
    finally:
        await a.db.close()


async def test_journals_that_gave_entries_are_read_a_few_to_a_pipeline(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each read may answer ``count`` entries twice over (claimed and new): 500 journals with a
    backlog (after a PostgreSQL outage) in one pipeline passed the socket's 2 s timeout, and every
    call of it was read again alone, one journal at a time (helper D's measurement: 330 of 500).
    A journal that gave the last round entries is now read JOURNALS_IN_FLIGHT to a pipeline."""
    async with archived_board(store, raw, postgres_url, "archive-backlog", 40, "backlog") as (board, a):
        polled: list[list[str]] = []  # the journals each pipeline read

        class Counted(fanout.Batch):
            async def outcomes(self) -> list[Any]:
                polled.append([_text(args[3]) for args, _ in self.calls if args[1] == a._poller.sha])
                return await super().outcomes()

        monkeypatch.setattr(archive, "batch", lambda client: Counted(client))
        journals = {keys.journal_key(p) for p in board.prefixes}
        await drain(a)  # what other modules left in the registry's journals
        for rounds in range(2):
            now = times.now_ms()
            await board.submit([Score(f"p{i}", rounds, f"m{rounds}", now) for i in range(400)], now_ms=now)
            polled.clear()
            assert await a.round() == 400
        # The second round read the 40 journals that gave the first entries 16 to a pipeline.
        ours = [len(keys_read) for keys_read in polled if journals & set(keys_read)]
        assert sum(len(journals & set(k)) for k in polled) == 40
        assert ours and max(ours) <= archive.JOURNALS_IN_FLIGHT, ours
        assert await drain(a) == 0
        assert len(await archived(postgres_url, board)) == 800  # 400 players, 2 matches


async def test_a_busy_round_acknowledges_and_trims_through_pipelines(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round that archived entries of many journals made three calls of its own for each (the
    newest deleted id for the gap check, ack.lua, trim.lua; recount.lua every 30 s), 16 at a time:
    writes spread over 20,000 journals outran one archiver at about 2,400 results a second. They go
    through one pipeline per node now: the round makes no Redis call of its own."""
    async with archived_board(store, raw, postgres_url, "archive-busy", 8, "busy") as (board, a):
        await drain(a)  # what other modules left in the registry's journals
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i, "m0", now) for i in range(40)], now_ms=now)
        assert await drain(a) == 40  # any script a node lacked is loaded by now
        await board.submit([Score(f"p{i}", 100 + i, "m1", now) for i in range(40)], now_ms=now)
        a._recounted.clear()  # every journal's recount is due
        calls: list[Any] = []
        direct = raw.execute_command

        async def counted(*args: Any, **options: Any) -> Any:
            calls.append(args[0])
            return await direct(*args, **options)

        monkeypatch.setattr(raw, "execute_command", counted)
        assert await a.round() == 40
        monkeypatch.undo()
        assert calls == []
        for prefix in board.prefixes:  # acknowledged, counted and trimmed
            key = keys.journal_key(prefix)
            assert await raw.xlen(key) == 0
            assert int(await raw.get(keys.journal_counts_of(key)) or 0) == 0
        assert len(await archived(postgres_url, board)) == 80


async def test_reads_that_failed_in_a_large_pipeline_are_made_again_a_few_to_a_pipeline(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An archiver that knows no busy journal yet (its first round: started again during a backlog,
    or one more archiver) reads every journal JOURNALS_AT_ONCE to a pipeline, and a backlog there
    passes the socket's timeout (helper D: 330 of 500 calls failed). The calls that failed are read
    again JOURNALS_IN_FLIGHT to a pipeline, this consumer's pending entries first; until 2026-12-06
    each was read again alone, one journal at a time."""
    made = archived_board(store, raw, postgres_url, "archive-first-backlog", 40, "first-backlog")
    async with made as (board, a):
        ours = {keys.journal_key(p) for p in board.prefixes}
        polled: list[int] = []  # the poll.lua calls of each pipeline of ours that kept its replies
        alone: list[str] = []
        read = a._read

        class Backlogged(fanout.Batch):
            async def outcomes(self) -> list[Any]:
                got = await super().outcomes()  # every call ran: its entries are this consumer's now
                polls = [args for args, _ in self.calls if args[1] == a._poller.sha]
                if any(_text(args[3]) in ours for args in polls):
                    if len(polls) > archive.JOURNALS_IN_FLIGHT:
                        raise TimeoutError("a backlog's replies took longer than the socket's timeout")
                    polled.append(len(polls))
                return got

        async def counted(key: str, own_first: bool = False) -> Any:
            alone.append(key)
            return await read(key, own_first)

        await drain(a)  # what other modules left in the registry's journals
        a._busy.clear()  # as a new archiver's first round
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i, "m1", now) for i in range(400)], now_ms=now)
        monkeypatch.setattr(archive, "batch", lambda client: Backlogged(client))
        monkeypatch.setattr(a, "_read", counted)
        assert await a.round() == 400
        monkeypatch.undo()
        assert alone == []
        assert polled and max(polled) <= archive.JOURNALS_IN_FLIGHT, polled
        assert len(await archived(postgres_url, board)) == 400


async def test_an_archiver_started_again_holds_at_an_unreadable_entry_among_its_own(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its own pending entries hold one that cannot be read (the journal was held there by the
    process that died: held journals are known in memory only). The first round of the archiver
    started again archives the entries before it, holds the journal there (nothing after it
    archived, nothing new read), and goes on past it once it is acknowledged by hand; each entry
    once, none skipped."""
    made = archived_board(store, raw, postgres_url, "archive-reborn-bad", 1, "reborn-bad")
    async with made as (board, first):
        await drain(first)
        (key,) = [keys.journal_key(p) for p in board.prefixes]
        now = times.now_ms()
        await board.submit([Score("before", 1, "m1", now)], now_ms=now)
        fields = {"b": board.config.id, "i": board.incarnation, "s": "0", "n": "1"}  # no results
        broken = _text(await raw.xadd(key, fields))
        await raw.incrby(keys.journal_counts_of(key), 1)
        await board.submit([Score("after", 3, "m3", now)], now_ms=now)
        (read,) = await first._poll([key])  # the reads of a round whose process then died
        assert ([e.id for e in read[0]], read[1] and read[1].id) == ([read[0][0].id], broken)
        await board.submit([Score("new", 4, "m4", now)], now_ms=now)  # after the death: not its own
        monkeypatch.setattr(archive, "RETRY_REFUSED_S", 0.0)
        again = await archiver(raw, store, postgres_url, "reborn-bad", claim_idle_s=3600)
        try:
            assert await drain(again) == 1
            assert [s.player_id for s in await archived(postgres_url, board)] == ["before"]
            assert key in again._held
            pending = await raw.xpending(key, GROUP)
            assert (pending["pending"], _text(pending["min"])) == (2, broken)  # "new" not read: held
            await raw.xack(key, GROUP, broken)  # the operator skips it
            assert await drain(again) == 2
            assert [s.player_id for s in await archived(postgres_url, board)] == ["before", "after", "new"]
            assert (await raw.xpending(key, GROUP))["pending"] == 0
        finally:
            await again.db.close()


async def test_own_pending_entries_with_one_deleted_by_hand_are_archived_at_the_first_round(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A pending entry deleted by hand (XDEL) among the entries of an archiver started again under
    its name: the read's XAUTOCLAIM drops it from the group at once (Redis 7 does, whatever its idle
    time), the others are archived at the first round, the results written since at the next, each
    once."""
    made = archived_board(store, raw, postgres_url, "archive-reborn-gone", 1, "reborn-gone")
    async with made as (board, first):
        await drain(first)
        (key,) = [keys.journal_key(p) for p in board.prefixes]
        now = times.now_ms()
        for i in range(6):
            await board.submit([Score(f"p{i}", i, f"m{i}", now)], now_ms=now)
        (read,) = await first._poll([key])
        assert len(read[0]) == 6
        await raw.xdel(key, read[0][2].id)
        await board.submit([Score("new", 9, "m9", now)], now_ms=now)
        again = await archiver(raw, store, postgres_url, "reborn-gone", claim_idle_s=3600)
        try:
            assert await again.round() == 5
            assert await again.round() == 1
            assert await drain(again) == 0
            got = sorted(s.player_id for s in await archived(postgres_url, board))
            assert got == ["new", "p0", "p1", "p3", "p4", "p5"]
        finally:
            await again.db.close()


async def test_two_archivers_under_one_name_archive_each_result_once(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two archivers given one name by mistake: the second's first round reads the entries the
    first has read and not yet committed (its own, by name), and both archive them. The upsert and
    ack.lua make that a replay: one row per result, the journals' count of results not archived
    taken off once (not below zero), the journals emptied."""
    async with archived_board(store, raw, postgres_url, "archive-twins", 3, "twin") as (board, one):
        await drain(one)
        ours = [keys.journal_key(p) for p in board.prefixes]
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i, "m1", now) for i in range(12)], now_ms=now)
        two = await archiver(raw, store, postgres_url, "twin")
        seconds: list[int] = []
        commit = one._archive

        async def late(batch: Any) -> int:  # `one` has read; `two` starts before it commits
            if batch and not seconds:
                seconds.append(await two.round())
            return await commit(batch)

        monkeypatch.setattr(one, "_archive", late)
        try:
            assert await one.round() == 12
            assert seconds == [12]
            monkeypatch.undo()
            assert await drain(one) == 0 and await drain(two) == 0
            assert len(await archived(postgres_url, board)) == 12
            for key in ours:
                assert await raw.xlen(key) == 0, key
                assert int(await raw.get(keys.journal_counts_of(key)) or 0) == 0, key
        finally:
            await two.db.close()


async def test_a_held_journal_skipped_by_hand_reads_the_rest_of_its_own_over_the_next_rounds(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A held journal reads its own pending entries alone ('0'), ``count`` at most. When its refused
    entry is acknowledged by hand more than ``count`` may wait behind it (handed out with it: an
    archiver started again under its name): they are archived over the next rounds ('0>'), then
    what was written meanwhile, not ``claim_idle_s`` later (30 s)."""
    made = archived_board(store, raw, postgres_url, "archive-held-many", 1, "held-many")
    async with made as (board, first):
        await drain(first)
        (key,) = [keys.journal_key(p) for p in board.prefixes]
        now = times.now_ms()
        huge = msgpack.packb(["m0", 2**63, board.codec.time_units(now)])  # no bigint holds it
        fields = {"b": board.config.id, "i": board.incarnation, "s": "0", "n": "1", "r": huge}
        refused = _text(await raw.xadd(key, fields))
        await raw.incrby(keys.journal_counts_of(key), 1)
        for i in range(7):
            await board.submit([Score(f"p{i}", i, f"m{i + 1}", now)], now_ms=now)
        await raw.xgroup_create(key, GROUP, id="0")  # as poll.lua makes it
        handed = await raw.xreadgroup(GROUP, "held-many", {key: ">"}, count=20)  # a killed archiver's
        assert len(handed[0][1]) == 8
        monkeypatch.setattr(archive, "RETRY_REFUSED_S", 0.0)
        a = await archiver(raw, store, postgres_url, "held-many", count=4, claim_idle_s=3600)
        try:
            assert await a.round() == 0  # its own first: held at the refused entry
            assert key in a._held
            await board.submit([Score("new", 9, "m9", now)], now_ms=now)
            assert await a.round() == 0  # held: nothing new read
            await raw.xack(key, GROUP, refused)  # the operator skips it
            assert [await a.round() for _ in range(4)] == [4, 3, 1, 0]
            assert sorted(s.player_id for s in await archived(postgres_url, board)) == [
                "new",
                *[f"p{i}" for i in range(7)],
            ]
            assert (await raw.xpending(key, GROUP))["pending"] == 0
        finally:
            await a.db.close()


async def test_a_dead_archivers_entry_deleted_by_hand_is_passed_over_by_the_takeover(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """XAUTOCLAIM (Redis 7) drops a pending entry deleted since from the group and names it apart
    (its reply's third list, which poll.lua leaves out). An archiver's first round takes over a dead
    archiver's entries with one of them deleted by hand: claimed, then read again from '0' as its
    own, the others are archived once each; none is left pending."""
    made = archived_board(store, raw, postgres_url, "archive-claim-gone", 1, "claim-gone")
    async with made as (board, dead):
        await drain(dead)
        (key,) = [keys.journal_key(p) for p in board.prefixes]
        now = times.now_ms()
        for i in range(6):
            await board.submit([Score(f"p{i}", i, f"m{i}", now)], now_ms=now)
        (read,) = await dead._poll([key])  # delivered to `dead`, which never writes them
        assert len(read[0]) == 6
        await raw.xdel(key, read[0][4].id)
        alive = await archiver(raw, store, postgres_url, "claim-gone-alive", claim_idle_s=0)
        try:
            assert await alive.round() == 5
            assert await drain(alive) == 0
            assert sorted(s.player_id for s in await archived(postgres_url, board)) == [
                "p0",
                "p1",
                "p2",
                "p3",
                "p5",
            ]
            assert (await raw.xpending(key, GROUP))["pending"] == 0
        finally:
            await alive.db.close()


async def test_a_read_of_its_own_that_finds_only_deleted_entries_reads_new_ones(raw: Any) -> None:
    """poll.lua's '0>' when the caller's first pending entries were deleted since: XAUTOCLAIM drops
    ``count`` of them from the group (Redis 7, whatever their idle time), the read from '0' answers
    the next without their fields, and the call reads new entries instead (its third value 0), not
    nothing. A pending entry left behind more deleted ones than that is read by a later call."""
    poll = Script(raw, script_source("poll.lua"))
    key = "{archive-poll-deleted}:journal"
    try:
        await raw.delete(key)
        for ms in range(1, 5):
            await raw.xadd(key, {"f": str(ms)}, id=f"{ms}-0")
        await raw.xgroup_create(key, GROUP, id="0")
        await raw.xreadgroup(GROUP, "c", {key: ">"}, count=10)
        await raw.xdel(key, "1-0", "2-0", "3-0")
        await raw.xadd(key, {"f": "5"}, id="5-0")

        def ids(reply: Any) -> list[Any]:
            claimed, read, own, _ = reply  # the 4th: a sentinel missing (none looked at here)
            return [[_text(i) for i, _ in claimed], [(_text(i), bool(f)) for i, f in read], own]

        args = [GROUP, "c", 3_600_000, 1, "0>"]
        assert ids(await poll(keys=[key], args=args)) == [[], [("5-0", True)], 0]
        assert ids(await poll(keys=[key], args=args)) == [[], [], 0]  # 2-0 dropped, 3-0 deleted: none new
        assert ids(await poll(keys=[key], args=args)) == [[], [("4-0", True)], 1]
        assert (await raw.xpending(key, GROUP))["pending"] == 2  # 4-0 and 5-0, not yet acknowledged
    finally:
        await raw.delete(key)
