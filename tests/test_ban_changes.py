"""The routers' copy of the ban list (router/moderation.py, ``BanCache``) follows the list's change log
(shardlb/moderation.py, ``Bans._note``): a ban or a lift makes each router read the fields it
changed, not the whole list, and whatever else happens to the list (a router of the release before
writing it, a restore, a change cut short, entries trimmed or lost in a failover), every copy ends
equal to the list once the version has moved and it refreshed. Against the suite's cluster and
PostgreSQL; the reference is the list itself, read whole."""

from __future__ import annotations

import contextlib
import random
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from router.moderation import BanCache
from shardlb import keys, moderation, times
from shardlb.archive import connect_db
from shardlb.store import BoardStore
from tests.test_rebuild import own_archive

pytestmark = pytest.mark.cluster


@pytest.fixture(autouse=True)
async def _empty_log(store: BoardStore) -> None:
    """Each test starts from an empty change log: a change another module's test left cut short
    (its first note, within the minute) is an open note a new copy reads again at each move, and the
    tests here count what a refresh reads."""
    await store.client.delete(keys.BANS_LOG)


class CountedBans(moderation.Bans):
    """The ban list of a real cluster client, counting what a refresh read: the whole list
    (``wholes``) or the fields named (``named``)."""

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.wholes = 0
        self.named: list[str] = []
        self.marks = 0  # reads of the list's mark (``whole``)

    async def whole(self) -> bool:
        self.marks += 1
        return await super().whole()

    async def all(self) -> list[moderation.Ban]:  # the whole list, as the release before read it
        self.wholes += 1
        return await super().all()

    async def scan(self) -> AsyncIterator[tuple[str, str | None]]:
        self.wholes += 1
        async for found in super().scan():
            yield found

    async def held_on(self, fields: Sequence[str]) -> list[tuple[str, str | None, bool]]:
        self.named += fields
        return await super().held_on(fields)


async def whole(client: Any) -> dict[str, str | None]:
    """The list as a router should hold it: field -> the incarnation its ban holds on."""
    return {
        moderation._text(field): moderation._incarnation(record)
        for field, record in (await client.hgetall(keys.BANS)).items()
    }


async def moved_by_hand(client: Any) -> None:
    """What a router of the release before does after writing the list: INCR the version."""
    await client.incr(keys.BANS_VERSION)


async def forget(client: Any, board: str, db: Any) -> None:
    """Take a test's board's bans out of the list (the version moved, as an old router moves it) and
    out of PostgreSQL, and close ``db``."""
    fields = [f for f in await whole(client) if f.startswith(board + "/")]
    if fields:
        await client.hdel(keys.BANS, *fields)
    await moved_by_hand(client)
    await db.execute("DELETE FROM bans WHERE board = %s", (board,))
    await db.close()


@contextlib.asynccontextmanager
async def copied(
    store: BoardStore, postgres_url: str, name: str
) -> AsyncIterator[tuple[str, CountedBans, BanCache, Any]]:
    """A test's board (``name`` and a random suffix), the list counting what a refresh reads, a
    router's copy of it and a PostgreSQL connection; the board's bans are forgotten at the end."""
    board = f"{name}-{secrets.token_hex(4)}"
    bans = CountedBans(store.client)
    db = await connect_db(postgres_url)
    try:
        yield board, bans, BanCache(bans), db
    finally:
        await forget(store.client, board, db)


async def test_a_ban_and_a_lift_reach_a_router_by_their_fields_not_by_reading_the_whole_list(
    store: BoardStore, postgres_url: str
) -> None:
    """Every ban or lift made every worker of every router read the whole list: at 100,000 bans
    half a second of its event loop and 12.7 MB from one primary, per worker, per ban. Now it reads
    the field the change wrote."""
    client = store.client
    async with copied(store, postgres_url, "counted") as (board, bans, cache, db):
        record = b'{"reason":"","by":"t","at":1}'
        seeded = {moderation.ban_field(board, f"seed{i}"): record for i in range(2000)}
        await client.hset(keys.BANS, mapping=seeded)
        await moved_by_hand(client)
        await cache.refresh()
        assert bans.wholes == 1 and cache.banned(board, "seed7")
        ban = moderation.Ban("cheater", board, "aimbot", "test", times.now_ms(), "inc1")
        await bans.add(db, ban, None)
        await cache.refresh()
        assert cache.banned(board, "cheater", "inc1") and not cache.banned(board, "cheater", "inc2")
        await bans.lift(db, "cheater", board, "test", "appeal", None)
        await cache.refresh()
        assert not cache.banned(board, "cheater")
        await cache.refresh()  # nothing moved: nothing read
        assert bans.wholes == 1, "the whole list was read again"
        # (fields of changes another test left open may be read again beside it: ``opened``)
        ours = [f for f in bans.named if f.startswith(board + "/")]
        assert ours == [moderation.ban_field(board, "cheater")] * 2
        assert cache.fields == await whole(client)


async def test_a_refresh_begun_before_a_ban_does_not_replace_the_copy_that_has_it(
    store: BoardStore, postgres_url: str
) -> None:
    """A ban's request refreshes its router's copy before it answers; the refresh task's pass,
    begun before the ban and ending after it, must not leave the copy without the ban: refreshes
    take turns, and the one begun after the ban reads it."""
    import asyncio

    class HeldBans(moderation.Bans):
        """Holds its first whole read, after reading, until ``go`` is set."""

        def __init__(self, client: Any) -> None:
            super().__init__(client)
            self.listed, self.go, self.held = asyncio.Event(), asyncio.Event(), False

        async def scan(self) -> AsyncIterator[tuple[str, str | None]]:
            found = [f async for f in super().scan()]
            if not self.held:
                self.held = True
                self.listed.set()
                await self.go.wait()
            for f in found:
                yield f

    bans = HeldBans(store.client)
    cache = BanCache(bans)
    player, board = f"held-{times.now_ms()}", "held-board"
    early = asyncio.create_task(cache.refresh())  # the task's pass: reads the list, then waits
    await bans.listed.wait()
    db = await connect_db(postgres_url)
    try:
        await bans.add(db, moderation.Ban(player, board, "", "test", times.now_ms()), None)
        late = asyncio.create_task(cache.refresh())  # the ban request's refresh, begun after the ban
        await asyncio.sleep(0.05)
        bans.go.set()
        await early
        await late
        assert cache.banned(board, player)
        await cache.refresh()
        assert cache.banned(board, player)
    finally:
        await bans.lift(db, player, board, "test", "cleanup", None)
        await db.close()


async def test_every_copy_ends_equal_to_the_list_whatever_writes_it(
    store: BoardStore, postgres_url: str
) -> None:
    """Random sequences of what writes the list: bans and lifts of this release (logged), a router
    of the release before (the list and an INCR, nothing logged), a restore from PostgreSQL, a
    change cut short between its write and its move, the log trimmed, and a failover that lost the
    log's last entry and the version's move but not the list's write (two primaries). Three
    copies refresh at random; each, once refreshed after the version moved, equals the list read
    whole. A copy that saw only logged changes since its last refresh never reads the whole list."""
    client = store.client
    rng = random.Random(20261206)
    board = f"random-{secrets.token_hex(4)}"
    players = [f"p{i}" for i in range(12)]
    db = await connect_db(postgres_url)
    caches = [BanCache(CountedBans(client)) for _ in range(3)]
    # Since each copy's last refresh, only logged changes, its position still in the log (a refresh
    # that found the version unmoved after a trim read nothing: its next move reads whole), and no
    # restore open.
    logged_only = [False] * 3
    cut = False  # a change whose move is lost, since the version last moved
    bans = moderation.Bans(client)
    try:
        for cache in caches:
            await cache.refresh()
        for step in range(250):
            kind = rng.choice(["ban", "ban", "lift", "lift", "old", "cut", "trim", "failover", "restore"])
            player = rng.choice(players)
            field = moderation.ban_field(board, player)
            if kind == "ban":
                inc = rng.choice([None, "i1", "i2"])
                await bans.add(db, moderation.Ban(player, board, "r", "t", times.now_ms(), inc), None)
            elif kind == "lift":
                await bans.lift(db, player, board, "t", "r", None)
            elif kind == "old":  # the release before: the record, then INCR
                if rng.random() < 0.5:
                    await client.hset(keys.BANS, field, b'{"reason":"old","by":"t","at":1}')
                else:
                    await client.hdel(keys.BANS, field)
                await moved_by_hand(client)
            elif kind == "cut":  # noted and written, never moved: the next move carries it
                await bans._note([field])
                if rng.random() < 0.5:  # a copy reads the note before the write
                    await rng.choice(caches).refresh()
                await client.hset(keys.BANS, field, b'{"reason":"cut","by":"t","at":2,"inc":"i3"}')
            elif kind == "trim":
                await client.xtrim(keys.BANS_LOG, maxlen=rng.choice([0, 1, 3]), approximate=False)
            elif kind == "failover":
                # The version's primary lost a change's move (its entry and the version's SET), the
                # list's primary kept its write; the change's first note stays (written before it).
                last = await client.xrevrange(keys.BANS_LOG, count=1)
                entry = {moderation._text(k): v for k, v in last[0][1].items()} if last else {}
                if not entry or entry["from"] == entry["to"]:
                    continue
                await client.xdel(keys.BANS_LOG, last[0][0])
                await client.set(keys.BANS_VERSION, entry["from"])
            else:
                await bans.restore(db)
            if kind in ("old", "trim", "failover", "restore"):
                logged_only = [False] * 3
            # A change whose move was lost (cut short, or in the failover: a copy still at the version
            # it went back to has nothing to look at) shows once a move follows it, as it did when
            # every move reloaded the whole list.
            cut = kind in ("cut", "failover") or (cut and kind == "trim")
            for i, cache in enumerate(caches):
                if rng.random() < 0.4:
                    counted = cache.bans
                    assert isinstance(counted, CountedBans)
                    wholes = counted.wholes
                    await cache.refresh()
                    if logged_only[i]:
                        assert counted.wholes == wholes, f"step {step}: read whole after logged changes only"
                    if not cut:  # a cut change shows once a move follows it
                        assert cache.fields == await whole(client), f"step {step} ({kind}), copy {i}"
                    kept = await client.xrange(keys.BANS_LOG, cache.position, cache.position)
                    logged_only[i] = cache.position == moderation.NO_CHANGE or bool(kept)
                    # A restore whose move the failover lost stays open: each move reads whole then.
                    logged_only[i] &= moderation.WHOLE not in cache.open
        for cache in caches:  # a last logged change moves the version past any cut one
            await bans.add(db, moderation.Ban("last", board, "r", "t", times.now_ms()), None)
            await cache.refresh()
            assert cache.fields == await whole(client)
        named = [len(c.bans.named) for c in caches if isinstance(c.bans, CountedBans)]
        assert min(named) >= 20, named  # the log was followed, not only the whole list read
    finally:
        await forget(client, board, db)


async def test_a_change_cut_short_whose_note_was_trimmed_is_read_with_the_whole_list(
    store: BoardStore, postgres_url: str
) -> None:
    """A change cut short (noted and written, never moved) shows at the next move through its note.
    If the log was trimmed past the copy's position meanwhile, note and all, the entries left lead
    from the copy's version to the list's all the same: only the missing position says that
    something was lost, and the copy reads the whole list."""
    client = store.client
    async with copied(store, postgres_url, "trimmed") as (board, bans, cache, db):
        await bans.add(db, moderation.Ban("first", board, "r", "t", times.now_ms()), None)
        await cache.refresh()
        cut = moderation.ban_field(board, "cut")
        await bans._note([cut])
        await client.hset(keys.BANS, cut, b'{"reason":"cut","by":"t","at":2}')
        await client.xtrim(keys.BANS_LOG, maxlen=0, approximate=False)
        await bans.add(db, moderation.Ban("next", board, "r", "t", times.now_ms()), None)
        wholes = bans.wholes
        await cache.refresh()
        assert cache.banned(board, "cut") and cache.banned(board, "next")
        assert bans.wholes == wholes + 1


async def test_the_change_log_keeps_no_entry_past_its_time(
    store: BoardStore, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry names a player (the ban's field): the log keeps entries a day at most (here 200 ms),
    however few changes follow, and a copy whose position went with them reads the whole list."""
    import asyncio

    monkeypatch.setattr(moderation, "CHANGES_KEPT_MS", 200)
    client = store.client
    async with copied(store, postgres_url, "aged") as (board, bans, cache, db):
        await bans.add(db, moderation.Ban("old", board, "r", "t", times.now_ms()), None)
        await cache.refresh()
        await asyncio.sleep(0.3)
        await bans.add(db, moderation.Ban("new", board, "r", "t", times.now_ms()), None)
        logged = [entry for _, entry in await client.xrange(keys.BANS_LOG)]
        names = " ".join(str(value) for entry in logged for value in entry.values())
        assert f"{board}/new" in names and f"{board}/old" not in names
        wholes = bans.wholes
        await cache.refresh()
        assert cache.banned(board, "old") and cache.banned(board, "new") and bans.wholes == wholes + 1


async def test_a_change_cut_short_after_a_copy_read_its_first_note_is_read_at_the_next_move(
    store: BoardStore, postgres_url: str
) -> None:
    """A copy may read a change's first note before the change writes the list (a refresh after
    another change's move, or a whole read whose mark is that note): it reads the field as it was.
    If the change is then cut short (its move never made: a crash, a lost reply, an unconfirmed
    write), the next move must still make the copy read that field, as a reload of the whole list
    did. Until 2026-12-06 (later that day) the copy's position had passed the note, and the field
    stayed out until the hourly whole read."""
    client = store.client
    board = f"opened-{secrets.token_hex(4)}"
    db = await connect_db(postgres_url)
    try:
        for whole_read in (False, True):
            bans = CountedBans(client)
            cache = BanCache(bans)
            await cache.refresh()
            cut = moderation.ban_field(board, f"cut-{whole_read}")
            if whole_read:  # the copy's first refresh: its mark is the cut change's note
                cache = BanCache(bans)
                await bans._note([cut])
                await cache.refresh()
            else:  # another change moved the version; the cut change's note follows its move
                other = moderation.Ban(f"other-{whole_read}", board, "r", "t", times.now_ms())
                await bans.add(db, other, None)
                await bans._note([cut])
                await cache.refresh()
                assert cut in bans.named  # read before the write
            await client.hset(keys.BANS, cut, b'{"reason":"cut","by":"t","at":2}')
            await bans.add(db, moderation.Ban(f"next-{whole_read}", board, "r", "t", times.now_ms()), None)
            wholes = bans.wholes
            await cache.refresh()
            assert bans.wholes == wholes, "the log was not followed"
            assert cache.banned(board, f"cut-{whole_read}"), f"whole_read={whole_read}"
            assert cache.fields == await whole(client)
    finally:
        await forget(client, board, db)


async def test_an_entry_the_copy_cannot_read_makes_it_read_the_whole_list(
    store: BoardStore, postgres_url: str
) -> None:
    """An entry of the log that is not a note of this release (written by hand, or by a later
    release in another form) says nothing a copy can follow: it reads the whole list, as at a move
    the log lacks. Until 2026-12-06 (later that day) every refresh failed on it (KeyError, or a
    decode error), and the copy stayed as it was until the entry left the log."""
    client = store.client
    board = f"unread-{secrets.token_hex(4)}"
    db = await connect_db(postgres_url)
    odd_entries: list[dict[str, str]] = [
        {"note": "by hand"},
        {"from": "1", "to": "2", "fields": "not json"},
        {"from": "x", "to": "2", "fields": "[]"},
        {"from": "1", "to": "2", "fields": '{"a": 1}'},
    ]
    try:
        for i, odd in enumerate(odd_entries):
            bans = CountedBans(client)
            cache = BanCache(bans)
            await bans.add(db, moderation.Ban(f"before{i}", board, "r", "t", times.now_ms()), None)
            await cache.refresh()
            await client.xadd(keys.BANS_LOG, odd)
            await bans.add(db, moderation.Ban(f"after{i}", board, "r", "t", times.now_ms()), None)
            wholes = bans.wholes
            await cache.refresh()
            assert cache.banned(board, f"after{i}"), odd
            assert bans.wholes == wholes + 1 and cache.fields == await whole(client)
            await bans.add(db, moderation.Ban(f"later{i}", board, "r", "t", times.now_ms()), None)
            await cache.refresh()  # past the odd entry now: the log is followed again
            assert cache.banned(board, f"later{i}") and bans.wholes == wholes + 1
    finally:
        await forget(client, board, db)


async def test_a_restore_whose_move_was_lost_is_read_whole_at_the_next_move(
    store: BoardStore, postgres_url: str
) -> None:
    """A restore (or a forgetting) writes many fields and moves the version with no field named.
    Were its move lost (a failover of the version's primary that kept the list's writes, or the
    call cut short before its move), the next ban's notes lead on from the version the copy holds,
    and until 2026-12-06 (later that day) the copy followed them and missed the restore's writes
    until its hourly whole read, where a reload at the next move read them before. Now a restore
    notes, before it writes, that the whole list changes: the next move makes the copy read it."""
    client = store.client
    async with copied(store, postgres_url, "restored") as (board, bans, cache, db):
        # A ban PostgreSQL does not hold: the restore drops it.
        stray = moderation.ban_field(board, "stray")
        await client.hset(keys.BANS, stray, b'{"reason":"stray","by":"t","at":1}')
        await bans.add(db, moderation.Ban("first", board, "r", "t", times.now_ms()), None)
        await cache.refresh()
        assert cache.banned(board, "stray")
        version = await bans.version()
        log_end = await client.xrevrange(keys.BANS_LOG, count=1)
        await bans.restore(db)
        # The failover: the version's primary lost the restore's move (and any entry made with it).
        since = "(" + moderation._text(log_end[0][0])
        made = await client.xrange(keys.BANS_LOG, min=since)
        notes = [moderation._change(e, [x for kv in v.items() for x in kv]) for e, v in made]
        moves = [note.id for note in notes if not note.first]
        if moves:
            await client.xdel(keys.BANS_LOG, *moves)
        await client.set(keys.BANS_VERSION, version)
        await cache.refresh()  # nothing to look at: the version is the copy's
        await bans.add(db, moderation.Ban("next", board, "r", "t", times.now_ms()), None)
        await cache.refresh()
        assert cache.banned(board, "next")
        assert not cache.banned(board, "stray"), "the restore's removal was missed past the next move"
        assert cache.fields == await whole(client)


async def test_a_copy_keeps_its_bans_while_redis_has_lost_the_list(
    store: BoardStore, postgres_url: str
) -> None:
    """A loss of the list's and the version's keys (a total loss of Redis, or their masters lost
    with their replicas) read as a version that never moved: until 2026-12-07 each router then
    loaded the empty list and took banned players' results until the list was written back
    (`rebuild --all`, the archiver's ``Bans.recover``) and its next refresh. A list that ever held a
    ban has a version, so a copy holding bans keeps them while the version is missing, and reads
    the list whole once it is back."""
    client = store.client
    async with copied(store, postgres_url, "lost") as (board, bans, cache, db):
        await bans.add(db, moderation.Ban("cheater", board, "aimbot", "t", times.now_ms()), None)
        await cache.refresh()
        assert cache.banned(board, "cheater")
        await client.delete(keys.BANS, keys.BANS_WHOLE, keys.BANS_VERSION, keys.BANS_LOG)  # the loss
        await cache.refresh()
        assert cache.banned(board, "cheater"), "the copy took the lost list's emptiness for a list"
        cache.load_by = 0.0  # its whole read due: still not the empty list
        await cache.refresh()
        assert cache.banned(board, "cheater")
        await bans.restore(db)  # written back from PostgreSQL: the version moves
        wholes = bans.wholes
        await cache.refresh()
        assert bans.wholes == wholes + 1 and cache.fields == await whole(client)
        assert cache.banned(board, "cheater")
        await bans.lift(db, "cheater", board, "t", "appeal", None)
        await cache.refresh()
        assert not cache.banned(board, "cheater")


async def test_a_copy_kept_across_a_loss_follows_the_changes_made_since_until_the_list_is_whole(
    store: BoardStore, postgres_url: str
) -> None:
    """A copy kept while Redis had lost the list (``BanCache.lost``) loaded the whole list at the
    first change made after the loss (a ban, a lift, through any router): the list then held that
    change alone, and until it was written back whole (the archiver's next refresh, ``Bans.recover``;
    with no archiver, `rebuild --all`) the router took the results of every player banned before
    the loss, as if it had kept nothing. Failed before: the banned player's results were taken after
    a ban of another player. Now the copy follows the change log from the loss on (it starts anew
    with the version), on top of what it kept, and its hourly whole read waits for the list's mark;
    the restore's move makes it read the list whole."""
    client = store.client
    async with copied(store, postgres_url, "kept") as (board, bans, cache, db):
        for player in ("cheater", "smurf"):
            await bans.add(db, moderation.Ban(player, board, "aimbot", "t", times.now_ms()), None)
        await cache.refresh()
        await client.delete(keys.BANS, keys.BANS_WHOLE, keys.BANS_VERSION, keys.BANS_LOG)  # the loss
        await cache.refresh()
        assert cache.banned(board, "cheater") and cache.banned(board, "smurf")
        await bans.add(db, moderation.Ban("late", board, "wallhack", "t", times.now_ms()), None)
        await bans.lift(db, "smurf", board, "t", "appeal", None)
        wholes = bans.wholes
        await cache.refresh()
        assert cache.banned(board, "cheater"), "the copy dropped what it kept at the first change"
        assert cache.banned(board, "late") and not cache.banned(board, "smurf")
        cache.load_by = 0.0  # its whole read due: the list is not whole yet
        await cache.refresh()
        assert bans.wholes == wholes and cache.banned(board, "cheater")
        assert await bans.recover(db) is not None  # the archiver's next refresh
        await cache.refresh()
        assert bans.wholes == wholes + 1 and cache.fields == await whole(client)
        assert cache.banned(board, "cheater") and cache.banned(board, "late")
        assert not cache.banned(board, "smurf")


async def test_a_copy_does_not_read_a_list_lost_alone_and_changed_whole_until_it_is_written_back(
    store: BoardStore, postgres_url: str
) -> None:
    """The list's slot lost alone (its master and replica, where another master serves the version
    and the change log: slots 345 and 3298), and a ban made before the archiver's write-back: the
    version is there, so the copy is not ``lost``, and follows the ban by its field, on top of what
    it held. Its hourly whole read then read the list holding that ban alone, and the router took
    the results of every player banned before the loss until the write-back's move (with no
    archiver, until `rebuild --all`). A copy that loaded the list marked whole waits for the mark
    again before its whole read, as a copy kept across a loss of the version does."""
    client = store.client
    async with (
        own_archive(postgres_url, "alone") as url,
        copied(store, url, "alone") as (board, bans, cache, db),
    ):
        await bans.restore(db)  # the list this archive's, marked whole
        await bans.add(db, moderation.Ban("cheater", board, "aimbot", "t", times.now_ms()), None)
        await cache.refresh()
        await client.delete(keys.BANS, keys.BANS_WHOLE)  # the list's slot: the version's kept
        await bans.add(db, moderation.Ban("late", board, "wallhack", "t", times.now_ms()), None)
        await cache.refresh()
        assert cache.banned(board, "cheater") and cache.banned(board, "late")
        wholes = bans.wholes
        cache.load_by = 0.0  # its hourly whole read, due before the list is written back
        await cache.refresh()
        assert cache.banned(board, "cheater"), "the copy read the list holding the late ban alone"
        assert bans.wholes == wholes
        assert await bans.recover(db) is not None  # the archiver's next refresh
        await cache.refresh()
        assert bans.wholes == wholes + 1 and cache.fields == await whole(client)
        assert cache.banned(board, "cheater") and cache.banned(board, "late")


async def test_a_whole_read_waiting_for_the_mark_costs_the_refresh_no_read_a_second(
    store: BoardStore, postgres_url: str
) -> None:
    """A copy whose hourly whole read waits for the list's mark (``BanCache.marked``) read the mark
    again at every refresh from then on: two reads a second in every worker instead of the version's
    one, for as long as the list stayed unmarked (until 2026-12-07, later that day, for good when
    its slot was lost while PostgreSQL held no ban; with no archiver running, until one runs).
    Failed before: a read of the mark at each of the refreshes. Now a whole read put off looks at
    the mark again after ``MARK_AGAIN_S``; a restore's move reads the list whole anyway."""
    client = store.client
    async with (
        own_archive(postgres_url, "unmarked") as url,
        copied(store, url, "unmarked") as (board, bans, cache, db),
    ):
        await bans.restore(db)  # the list this archive's, marked whole
        await bans.add(db, moderation.Ban("cheater", board, "aimbot", "t", times.now_ms()), None)
        await bans.lift(db, "cheater", board, "t", "appeal", None)  # no ban left
        await cache.refresh()
        assert cache.marked
        await client.delete(keys.BANS, keys.BANS_WHOLE)  # the list's slot: the version's kept
        cache.load_by = 0.0  # its hourly whole read due
        marks = bans.marks
        for _ in range(5):
            await cache.refresh()
        assert bans.marks - marks <= 1, "the mark read at every refresh"


async def test_a_copy_kept_across_a_loss_keeps_its_bans_when_it_reads_the_list_before_it_is_whole(
    store: BoardStore, postgres_url: str
) -> None:
    """A copy kept across a loss (``BanCache.lost``) that had to read the list whole before the list
    was written back (a change it cannot follow: the write-back's own first note, read with a ban
    made while the restore writes; a forgetting's; a router of the release before) took the list as
    it was, the changes since the loss and the restore's pages written so far: the router took the
    results of every player banned before the loss whose record was not yet written again, for as
    long as the restore ran (seconds at a large list). Failed before: the banned player's result was
    taken after a ban made during the write-back. Now a copy of a list marked whole, or kept, keeps
    what it held beside a list read unmarked, until it reads the list marked."""
    client = store.client
    async with (
        own_archive(postgres_url, "inflight") as url,
        copied(store, url, "inflight") as (board, bans, cache, db),
    ):
        await bans.add(db, moderation.Ban("cheater", board, "aimbot", "t", times.now_ms()), None)
        await cache.refresh()
        await client.delete(keys.BANS, keys.BANS_WHOLE, keys.BANS_VERSION, keys.BANS_LOG)  # the loss
        await cache.refresh()
        # The archiver's write-back begins (``Bans.restore``: its mark, its first note), and a ban is
        # made before its first page.
        await client.set(keys.BANS_WHOLE, moderation.WRITING + "under-way", px=moderation.WRITING_MS)
        await bans._note([moderation.WHOLE])
        await bans.add(db, moderation.Ban("late", board, "wallhack", "t", times.now_ms()), None)
        await cache.refresh()
        assert cache.banned(board, "late")
        assert cache.banned(board, "cheater"), "the copy read the list being written back as the list"
        await client.delete(keys.BANS_WHOLE)
        assert await bans.recover(db) == 2  # the write-back, to its end
        await cache.refresh()
        assert cache.fields == await whole(client) and cache.marked and not cache.kept
        await bans.lift(db, "cheater", board, "t", "appeal", None)
        await cache.refresh()
        assert not cache.banned(board, "cheater") and cache.banned(board, "late")
