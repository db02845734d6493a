"""Sharding strategies: which physical shard holds a player, and which shards a read merges.

A board owns ``physical`` shards, numbered 0..physical-1 and placed on slots by ``keys.shard_prefix``.

- ``hash``: shard = hash(player) mod N. Every read merges all N shards.
- ``region``: each region owns ``shards_per_region`` hash shards; a region read merges its own group,
  a global read merges every group.
- ``band``: N hash shards hold each player's record and all period entries (as in ``hash``), plus one
  shard per points band that indexes the ``total`` board by band. The band index makes top-N one call
  and rank a sum of band sizes plus a rank inside one band. A player whose total crosses a boundary is
  moved between band shards under a per-player version, so late moves can never resurrect an old entry.
  The home shard records each move until every band shard has taken it (the player's next write or
  a retry sends it again, and so does the archiver's repair loop within seconds: shardlb/bands.py),
  so a lost band call never loses a move; the new band takes the add before the old one drops the
  row, so a player never drops out of every band on the way.

On a region board a player has one home: the first region they post under. The shards a player may
live in (the same index in every region) share one slot, so the write script sees all of them and
refuses a result under a second region (``region_conflict``) atomically.
"""

from __future__ import annotations

import bisect
import functools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from shardlb.config import Sharding
from shardlb.errors import InvalidInput


def player_hash(player: str) -> int:
    """A hash of the player id that is stable across processes and versions (unlike ``hash()``)."""
    return zlib.crc32(player.encode())


@dataclass(frozen=True)
class Layout:
    sharding: Sharding
    order: str = "desc"

    @property
    def strategy(self) -> str:
        return self.sharding.strategy

    @property
    def physical(self) -> int:
        return self.sharding.shards + len(self.sharding.bands)

    def region_index(self, region: str | None, field: str = "region") -> int:
        try:
            return self.sharding.regions.index(region or "")
        except ValueError as e:
            raise InvalidInput(
                f"region must be one of {', '.join(self.sharding.regions)}", field, "invalid_region"
            ) from e

    def home(self, player: str, region: str | None = None, field: str = "region") -> int:
        """The shard that holds the player's record and every period entry."""
        if self.strategy == "region":
            per = self.sharding.shards_per_region
            return self.region_index(region, field) * per + player_hash(player) % per
        return player_hash(player) % self.sharding.shards

    def homes(self, players: Sequence[str], region: str | None = None) -> list[int]:
        """``home`` of each of ``players``, computed in one pass (players:query places up to 1000)."""
        if self.strategy == "region":
            per = self.sharding.shards_per_region
            first = self.region_index(region) * per
            return [first + zlib.crc32(p.encode()) % per for p in players]
        shards = self.sharding.shards
        return [zlib.crc32(p.encode()) % shards for p in players]

    def candidates(self, player: str, region: str | None = None) -> list[int]:
        """Every shard the player may live in (one, except on a region board read without a region)."""
        if self.strategy == "region" and region is None:
            per = self.sharding.shards_per_region
            offset = player_hash(player) % per
            return [r * per + offset for r in range(len(self.sharding.regions))]
        return [self.home(player, region)]

    def slot_group(self, shard: int) -> tuple[int, int]:
        """Where ``shard``'s slot is placed, as (index, count) of the board's slot windows. Region
        boards give the shards of one index in every region one slot (see the module docstring)."""
        if self.strategy == "region":
            per = self.sharding.shards_per_region
            return shard % per, per
        if self.strategy == "band" and self.sharding.placement == "spread":
            return self._spread[shard], self.physical
        return shard, self.physical

    @functools.cached_property
    def _spread(self) -> list[int]:
        """Each shard's slot window on a "spread" band board: the home shards and the bands each
        spaced evenly over the windows, interleaved (home i at (i + 1/2) / homes of the way, band b
        at (b + 1/2) / bands; a home first on a tie). With as many bands as homes the windows go
        home 0, band 0, home 1, band 1, ...: on a cluster of that many masters (each owning an equal
        run of the slots) every master holds one home shard and one band."""
        homes, bands = self.sharding.shards, len(self.sharding.bands)
        spots = [((2 * i + 1) * bands, 0, i) for i in range(homes)]  # (i + 1/2) / homes, scaled
        spots += [((2 * b + 1) * homes, 1, homes + b) for b in range(bands)]
        window = [0] * self.physical
        for place, (_, _, shard) in enumerate(sorted(spots)):
            window[shard] = place
        return window

    def rivals(self, shard: int) -> list[int]:
        """The other regions' shards that a player of ``shard`` could also live in (region boards)."""
        if self.strategy != "region":
            return []
        per = self.sharding.shards_per_region
        offset = shard % per
        return [r * per + offset for r in range(len(self.sharding.regions)) if r * per + offset != shard]

    def view(self, total: bool, region: str | None = None) -> list[int]:
        """The shards a read merges. For the band total these are the band shards, best band first."""
        if self.strategy == "region" and region is not None:
            per = self.sharding.shards_per_region
            start = self.region_index(region) * per
            return list(range(start, start + per))
        if self.strategy == "band" and total:
            bands = [self.sharding.shards + b for b in range(len(self.sharding.bands))]
            return bands[::-1] if self.order == "desc" else bands
        return list(range(self.sharding.shards))

    def band_shard(self, points: int) -> int:
        """The band shard for a total of ``points`` (band boards only)."""
        return self.sharding.shards + bisect.bisect_right(self.sharding.bands, points) - 1
