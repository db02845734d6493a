"""Every Redis key name shardlb uses, and the placement of shards on hash slots.

All keys of one shard share one hash tag, so one Lua call can touch every period of the shard, its
dedup buckets and its key index atomically:

    lb:{<tag>}:<board>:<inc>:<shard>:total                    sorted set, the all-time board
    lb:{<tag>}:<board>:<inc>:<shard>:d:2026-11-30 / w:2026-W48 / m:2026-11   dated period boards
    lb:{<tag>}:<board>:<inc>:<shard>:dd:<bucket>              incr dedup set for one time bucket
    lb:{<tag>}:<board>:<inc>:<shard>:pin:<bucket>             first server time of results sent without one
    lb:{<tag>}:<board>:<inc>:<shard>:pspan                    "<span>:<bucket>": pin hashes' span, since when
    lb:{<tag>}:<board>:<inc>:<shard>:idx                      this shard's keys, scored by expiry
    lb:{<tag>}:<board>:<inc>:<shard>:ver / :pend              band boards: versions, unfinished band moves
    lb:{<tag>}:<board>:<inc>:<shard>:vrm / :vfl               band homes: removed players' versions, floor
    lb:{<tag>}:<board>:<inc>:<shard>:gone                     set (with a TTL) when the board is deleted
    lb:{<tag>}:<board>:<inc>:<shard>:swap                     a rebuild's forced swap, until its apply (a TTL)
    lb:{<tag>}:<board>:<inc>:<shard>:here                     the shard's sentinel (while it holds its data)
    lb:{<tag>}:<board>:<inc>:<shard>:log                      the journal: a stream of applied results
    lb:{<tag>}:<board>:<inc>:<shard>:logn                     its results not archived yet (a count)
    lb:{<tag>}:<board>:<inc>:<shard>:seen                     inactive_after boards: player -> last post ms
    lb:{<tag>}:<board>:<inc>:<shard>:rate:<minute> / rated:<minute>   per-minute result counts (sanity)
    lb:bans / lb:bans:v                                       banned players (scope/player -> record), version
    lb:{lb:bans:v}:log                                        the ban list's change log (beside the version)
    lb:{lb:bans}:whole                                        the ban list's mark: written whole (beside it)
    lb:{<tag>}:<board>:<inc>:<shard>:frozen:d:2026-11-30      set once that period is frozen (expires with it)
    lb:{<tag>}:<board>:<inc>:<shard>:frozen:total             set once the board is closed (a season archive)
    lb:{<tag>}:<board>:<inc>:<shard>:frozen:d:2026-11-30:paid the settlement that paid it (expires with it)
    lb:{<tag>}:<board>:<inc>:<shard>:mv / seal / chg / chgw   a reshard's marker, seal, changes, changes taken
    lb:{<tag>}:<board>:<inc>:<shard>:fence                    the epoch of the mover holding a reshard (a TTL)
    lb:reshard:<board>                                        the lease of the process resharding a board
    lb:{lb:reshard:<board>}:starting                          a mover started, not leased yet (a TTL)
    lb:boards / lb:{196e9}:boards:reshards                    the registry; its boards under reshard
    lb:{196e9}:boards:v                                       the registry's version (moves with each change)
    lb:{196e9}:boards:changes                                 its last moves, each naming the board changed
    lb:{196e9}:boards:owed:<board>                            deletions PostgreSQL lacks the mark of (a TTL)
    lb:{<tag>}:ack                                            a replica-acknowledged write's marker (expires)

``<inc>`` is the board's incarnation, a token drawn when the board is created: a board deleted and
created again under the same id never shares a key with its former self, so a router that still
holds the old one can neither see nor revive the new one's data (and the old one's ``gone`` marker
refuses its writes).

A board resharded (shardlb/reshard.py) gets a new layout generation: from generation 1 on, ``<inc>``
is spelled ``<incarnation>.<generation>``, so the new layout's keys never meet the old one's while
both exist. The incarnation alone stays the board's identity in journals and in PostgreSQL.

``<tag>`` is a short token chosen from a table of one token per slot, so shard i of N lands exactly
where we want it: inside the middle quarter of the i-th N-th of the 16384 slots (offset by a hash of
the board id, so many boards do not pile onto the same slots). Shards then spread over the masters
by construction instead of by CRC16 chance. A layout may place several shards on one slot on
purpose (``group``): a region board puts the shards a player could live in under one tag, so one
script call can see all of them.
"""

from __future__ import annotations

import zlib
from binascii import crc_hqx
from functools import lru_cache
from pathlib import Path

SLOTS = 16384
BOARDS = "lb:boards"
# The ids of the registry's records that name a reshard under way (a set), written by registry.lua
# in the same call as the record: its tag is the token of the registry's slot (7553), so no
# failover keeps one write without the other. And the lease of the routers' whole look at the
# registry, which finds what the index lacks (router/reshards.py).
RESHARDS = "lb:{196e9}:boards:reshards"
RESHARDS_LOOK = "lb:{196e9}:boards:reshards:look"
# The registry's version, drawn anew (by the writer) at every change of a record, in the same
# registry.lua call, in the registry's slot too: a reader that holds the registry reads it again
# only when the version moved (``BoardStore.follow``: the archiver's refresh, the journal watch).
BOARDS_VERSION = "lb:{196e9}:boards:v"
# The last moves of that version, newest first, each naming the board whose record changed (a list
# of at most ``store.CHANGES_KEPT``), written in the same call: a router that follows the version
# (router/boards.py) learns which of the boards it keeps changed, without reading their records.
BOARDS_CHANGES = "lb:{196e9}:boards:changes"
# A digest of each record (a hash: board id -> the first 16 hex digits of its SHA-1), written by
# registry.lua in the same call, and under the field '' (never a board id) the version through which
# every digest is its record's: a router that cannot tell from the log which records changed
# compares the digests of those it keeps, and reads only the records whose digest differs
# (shardlb/scripts/digests.lua, ``BoardStore.digests``).
BOARDS_DIGESTS = "lb:{196e9}:boards:digests"
BANS = "lb:bans"  # hash "<board or *>/<player>" -> ban record JSON (shardlb/moderation.py)
BANS_VERSION = "lb:bans:v"  # drawn anew at every change of BANS: routers reload the set when it moves
# The fields each change of BANS wrote, in the version's hash slot (its tag is the version's name), so
# one script logs a change and moves the version at once: routers read the fields named since they
# last looked instead of the whole list (shardlb/moderation.py, ``Bans.changes``).
BANS_LOG = "lb:{lb:bans:v}:log"
# The mark of a ban list written whole from PostgreSQL, in the list's hash slot (its tag is the list's
# name), so a loss of the list takes the mark with it, whatever is written after: a list without it
# is written back (shardlb/moderation.py, ``Bans.recover``).
BANS_WHOLE = "lb:{lb:bans}:whole"
# The routers' journal watch (router/journals.py): the last reading of every journal, shared by
# every worker while it lives, and the lease of the one worker reading them anew.
JOURNAL_LAG = "lb:journals:lag"
JOURNAL_LAG_LEASE = "lb:journals:lag:lease"


def slot_of(key: str) -> int:
    """The cluster slot of a key (CRC16 of its hash tag, as Redis computes it)."""
    data = key.encode()
    start = data.find(b"{")
    if start != -1:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return crc_hqx(data, 0) % SLOTS


# ``search_slot_tokens``'s table, kept: the search costs a process 0.2-0.4 s of CPU, and every router,
# CLI call and bench process needs it (tests/test_keys.py checks the file against the search).
TOKENS_FILE = Path(__file__).with_name("slot_tokens.txt")


@lru_cache(maxsize=1)
def slot_tokens() -> tuple[str, ...]:
    """One short token per slot (``search_slot_tokens``), read from TOKENS_FILE; searched where the
    file is missing or not a whole table."""
    try:
        tokens = tuple(TOKENS_FILE.read_text().split(","))
    except OSError:
        tokens = ()
    return tokens if len(tokens) == SLOTS else search_slot_tokens()


def search_slot_tokens() -> tuple[str, ...]:
    """One short token per slot: the first hex number whose CRC16 lands on that slot (~315k tries)."""
    table: list[str | None] = [None] * SLOTS
    missing, n = SLOTS, 0
    while missing:
        token = format(n, "x")
        slot = crc_hqx(token.encode(), 0) % SLOTS
        if table[slot] is None:
            table[slot] = token
            missing -= 1
        n += 1
    return tuple(t for t in table if t is not None)


def slot_window(shard: int, shards: int) -> tuple[int, int]:
    """The slots (inclusive) a shard may land on: the middle quarter of its N-th, at least one slot."""
    start, end = shard * SLOTS // shards, (shard + 1) * SLOTS // shards
    center = start + (end - start) // 2
    half = (end - start) // 8
    return center - half, center + half


def shard_slot(board: str, shard: int, shards: int) -> int:
    if not 0 <= shard < shards <= SLOTS:
        raise ValueError(f"shard {shard} of {shards} is out of range")
    lo, hi = slot_window(shard, shards)
    return lo + zlib.crc32(board.encode()) % (hi - lo + 1)


def shard_prefix(
    board: str, shard: int, shards: int, incarnation: str = "0", group: tuple[int, int] | None = None
) -> str:
    """The common start of every key of shard ``shard`` of ``shards`` of ``board``.

    ``group`` (index, count) places the shard's slot as that index of that many instead of as
    ``shard`` of ``shards``.
    """
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} of {shards} is out of range")
    tag = slot_tokens()[shard_slot(board, *(group or (shard, shards)))]
    return f"lb:{{{tag}}}:{board}:{incarnation}:{shard}:"


def layout_token(incarnation: str, generation: int) -> str:
    """The ``<inc>`` part of a board's key names for a layout generation (see the module docstring)."""
    return incarnation if generation == 0 else f"{incarnation}.{generation}"


def move_key(prefix: str) -> str:
    """A reshard's marker on a shard: 't' tracking changes, 'm' moved away, 'c' not open yet."""
    return prefix + "mv"


def seal_key(prefix: str) -> str:
    """Set (with a lease) while the mover takes a tracked shard's last changes: writes wait."""
    return prefix + "seal"


def changes_key(prefix: str) -> str:
    """The dedup members (match NUL player) of results written while the shard was tracked."""
    return prefix + "chg"


def taken_key(prefix: str) -> str:
    """The changes the mover took and has not copied yet (kept there should the mover die)."""
    return prefix + "chgw"


def fence_key(prefix: str) -> str:
    """The epoch of the mover that holds the reshard, on one shard of either layout (its slot): each
    of the mover's writes there checks it (shardlb/reshard_copy.py). A deletion removes it before it
    drops the shard (shardlb/store.py), so no mover writes there again."""
    return prefix + "fence"


def lease_key(board: str) -> str:
    return f"lb:reshard:{board}"


def starting_key(board: str) -> str:
    """A mover of ``board``'s reshard started and not holding the lease yet (its token, with a TTL:
    shardlb/reshard.py, ``Resharder.announce``); its tag is the lease's name, so both are in one slot."""
    return f"lb:{{{lease_key(board)}}}:starting"


def owed_key(board: str) -> str:
    """The incarnations of ``board`` whose DELETE began in PostgreSQL and has not recorded its
    deletion there yet (a set, with a TTL: shardlb/archive.py, ``owe_deletion``). In the registry's
    slot, so no failover keeps the record's removal without the entry written before it."""
    return f"lb:{{196e9}}:boards:owed:{board}"


def deleted_key(board: str, incarnation: str) -> str:
    """Set when the board of that incarnation is deleted (shardlb/store.py), whatever its layout:
    the archiver's evidence that a board the registry lacks was deleted, not lost with Redis."""
    return f"lb:deleted:{board}:{incarnation}"


def period_key(prefix: str, period: str) -> str:
    """``period`` is ``total`` or a dated name such as ``d:2026-11-30``."""
    return prefix + period


def dedup_key(prefix: str, bucket: int) -> str:
    # write.lua builds this name (and pin_key's) itself from the prefix: keep the two in step.
    return f"{prefix}dd:{bucket}"


def index_key(prefix: str) -> str:
    return prefix + "idx"


def version_key(prefix: str) -> str:
    return prefix + "ver"


def pending_key(prefix: str) -> str:
    return prefix + "pend"


def removed_versions_key(prefix: str) -> str:
    """A band board's home shard: the players removed there whose versions are still kept (a
    sorted set, player -> the removal's time, ms), until ``BandMoves.prune`` forgets them.
    remove.lua builds this name itself from the prefix: keep the two in step."""
    return prefix + "vrm"


def version_floor_key(prefix: str) -> str:
    """A band board's home shard: the highest version ``BandMoves.prune`` forgot there (a string).
    A player without a version starts above it (write.lua, remove.lua build this name themselves)."""
    return prefix + "vfl"


def pin_key(prefix: str, bucket: int) -> str:
    """The pin hash named by ``bucket``, the first of the PIN_SPAN buckets it spans (write.lua)."""
    return f"{prefix}pin:{bucket}"


def pin_span_key(prefix: str) -> str:
    """The shard's pin marker (write.lua): the span of its pin hashes, and the bucket from which
    on every pin is in a hash of that span."""
    return prefix + "pspan"


def gone_key(prefix: str) -> str:
    return prefix + "gone"


def removals_key(prefix: str) -> str:
    """The shard's recent removals (remove.lua): player -> the removal's time units, kept for the
    dedup window; write.lua answers `d` to a result of theirs achieved before it. remove.lua and
    write.lua build this name themselves from the prefix: keep them in step."""
    return prefix + "rmv"


def removal_position_field(player: str) -> str:
    """The field of ``removals_key`` that holds where the delete entry that last removed ``player``
    on that shard is (remove.lua builds it itself, and writes its value: ``removal_position`` reads
    it). As ``removal_request_field`` of no request: a reshard's copy takes it to the player's home."""
    return f"\x00{player}"


def removal_position(value: str) -> str:
    """The journal id that a ``removal_position_field`` value holds: remove.lua writes the record's
    units, ".", then the id as digits (its ms on 13 places, then its sequence), so that it reads
    as a number where the hash's values are read so. "" for a value that holds none."""
    digits = value.partition(".")[2]
    if len(digits) <= 13 or not digits.isdigit():
        return ""
    return f"{int(digits[:13])}-{int(digits[13:])}"


def removal_position_value(units: int, entry_id: str) -> str:
    """A ``removal_position_field`` value (or a ``removal_request_position_field`` one), as
    remove.lua writes it: ``units``, ".", then the journal id ``entry_id`` as digits (its ms on 13
    places, then its sequence). ``removal_position`` reads it back."""
    ms, _, seq = entry_id.partition("-")
    return f"{units}.{int(ms):013d}{int(seq)}"


def removal_request_field(request: str, player: str) -> str:
    """The field of ``removals_key`` that records the removal ``request`` of ``player`` on that
    shard (remove.lua builds it itself: keep the two in step). Ids hold no NUL, so it is never a
    player's field, and a reshard's copy takes it to the player's home (after the NUL)."""
    return f"{request}\x00{player}"


def removal_request_position_field(request: str, player: str) -> str:
    """The field of ``removals_key`` that holds where the delete entry of the removal ``request``'s
    call that recorded ``player`` on that shard is (remove.lua builds it itself, and writes its
    value as ``removal_position`` reads it): the request sent again reads that entry alone. A
    request's name holds no U+0001 (``moderation.remove`` refuses one), so it is never a request's
    field, and a reshard's copy takes it to the player's home (after the NUL)."""
    return f"\x01{request}\x00{player}"


def removals_marker_key(prefix: str) -> str:
    """A string beside ``removals_key`` with its expiry: write.lua reads it in its one MGET."""
    return prefix + "rmvon"


def sentinel_key(prefix: str) -> str:
    """A string set when the shard comes to exist (the board's creation, `rebuild --all`'s restore
    and each whole rebuild of the shard: shardlb/store.py, shardlb/rebuild.py) and never expiring:
    in the shard's own slot, it goes with the shard's keys when Redis loses that slot alone, and the
    archiver, finding it missing, marks the shard not rebuilt (shardlb/archive.py). drop.lua builds
    this name itself from the prefix: keep them in step."""
    return prefix + "here"


def swap_marker_key(prefix: str) -> str:
    """A token a rebuild's forced swap sets (with a TTL, listed in the key index) and the apply
    after it checks and unlinks in its call (shardlb/rebuild.py, ``Rebuilder._apply_live``):
    rebuild.lua builds this name itself from the prefix: keep them in step."""
    return prefix + "swap"


def journal_key(prefix: str) -> str:
    return prefix + "log"


def journal_counts_key(prefix: str) -> str:
    """The journal's results not archived yet: up as write.lua journals them, down as ack.lua
    acknowledges them. write.lua builds this name itself from the prefix: keep the two in step."""
    return prefix + "logn"


def journal_counts_of(journal: str) -> str:
    """The counts key of the journal named ``journal`` (``journal_key``'s name)."""
    return journal_counts_key(journal.removesuffix(journal_key("")))


def activity_key(prefix: str) -> str:
    return prefix + "seen"


def rate_keys(prefix: str, minute: int) -> tuple[str, str]:
    """The per-minute sanity counters of a shard: (match, player) pairs counted, and counts per player."""
    return f"{prefix}rated:{minute}", f"{prefix}rate:{minute}"


def frozen_key(prefix: str, period: str) -> str:
    """The marker that ``period`` (``d:2026-11-30``) is frozen on this shard: write.lua applies
    nothing more to it. It lives in the shard's slot and expires with the period's key."""
    return f"{prefix}frozen:{period}"


def paid_key(prefix: str, period: str) -> str:
    """The record that ``period`` was settled and paid: the settlement's id, set once its awards
    are committed in PostgreSQL, expiring with the period's key (the total's: never). A settlement
    asked for again against an archive that lacks that settlement (restored from a backup taken
    before it) is refused rather than paid twice (shardlb/settlement.py). Named under ``frozen:``
    so a reshard copies it to every new shard as it does the freeze markers."""
    return f"{prefix}frozen:{period}:paid"


def ack_key(slot: int) -> str:
    """The marker a replica-acknowledged write sets on ``slot`` right before its WAIT, so the WAIT
    covers every earlier write to that primary (shardlb/fanout.py). One per slot, with a TTL."""
    return f"lb:{{{slot_tokens()[slot]}}}:ack"
