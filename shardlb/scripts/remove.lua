-- Remove players from every period of ONE shard (shardlb/moderation.py). All KEYS share the tag.
--
-- KEYS[1] the shard's key index, KEYS[2] its `gone` marker, KEYS[3] its journal,
-- KEYS[4] its version hash, KEYS[5] its pending band moves (band boards), KEYS[6..] every key the
--         caller found in the key index (period boards, activity set, dedup sets...).
-- ARGV[1] MessagePack: journal (1: append a delete entry), bands (how many band shards; 0: none),
--         board id, incarnation, shard, stale_before (ms; 0: remove unconditionally; otherwise a
--         player is removed only if the activity set, KEYS[6], has them at or before it),
--         removed_units (the removal's time in the board's time units; -1: leave no record),
--         record_until (ms: when the shard's record of removals may expire),
--         time_bits and earliest (1: tiebreak earliest) of the board's codec, to read the time of a
--         score: a player's record is the later of removed_units and 1 + the latest time of their
--         removed entries (a result dated ahead of the clock, up to 5 minutes, stays refused too;
--         on an incr board a 0-point result leaves the entry's time alone since 2026-12-05, and
--         only its dedup record refuses its retry: docs/design-notes.md, "A retry after a removal"),
--         forget_before (units: a record below it is from a removal older than the dedup window),
--         removed_at (ms: the removal's time, recorded in `vrm` on band boards; absent: not recorded),
--         request (optional; '': none): the name of the removal asked for (the router's
--         `remove/<X-Request-Id>`), and again (optional, 1: removed_units are the time an earlier
--         call of that request recorded on another shard; see below), the journal's bounds
--         (optional; 0: none): entries, then results not archived (write.lua's; see below),
--         sentinel (optional; 1: the shard's `here` must exist, as write.lua's header item says:
--         without it the call is refused, SHARDLOST and the shard, nothing changed),
--         pointed (optional; -1 or absent: none): with stale_before, on a journaled board, the
--         units under which each player removed points at the delete entry (see the end),
--         swept (optional; {} or absent: none): with stale_before, how the cleanup records each
--         player it removes: {shift, unit, cap}, the record floor((seen + shift) / unit) + 1 (at
--         most cap) from the player's last post `seen` (ms, the activity set's), kept only when at
--         or above forget_before (see "The inactive cleanup's records" below)
-- ARGV[2] MessagePack array of player ids
-- Returns {'stale'} when the key index lists a key the caller did not pass (a period began since it
-- read the index: it reads again), else {'ok', journal id or '', per player: 1 removed / 0 absent,
-- band version (0 when not a band board; -1 when the request had removed the player here already)}.
-- Sorted sets among KEYS[6..] lose the players; nothing else changes, except on band boards: the
-- player's version is bumped and every band index recorded as pending, so the band shards' removal
-- (band.lua 'r' ops at that version) is sent again by a retry, and a later write re-adds cleanly.
-- The player is also recorded in the home shard's `vrm` (player -> removed_at), a sorted set the
-- removal itself leaves alone: once the removal is older than the dedup window, the repair loop
-- forgets the player's versions there and on every band (prune.lua, shardlb/bands.py). A player
-- without a version (never seen, or forgotten) starts above the shard's `vfl`, the highest version
-- forgotten, as in write.lua.
-- On a journaled board at either bound of its journal the call is refused (JOURNALFULL), nothing
-- changed: a removal's retry converges, as after any failure (shardlb/moderation.py).
-- The delete entry (`n`: its count of players, which `logn` counts as write.lua counts results;
-- `x`: the players actually removed; `k`: the records below, player and units,
-- flat; with a request, `q` its name and `u` the units its records hold; with `again`, `a`: per
-- player of `x` whose entry stayed in some period, the player and those periods' names, comma-
-- separated, flat) goes in the same call: the archiver records it, a rebuild drops this shard's
-- results of those players journaled before it (but in the periods `a` names, which this call left
-- whole) and puts the records back, the request's too. An entry without `a` kept nothing.
-- With removed_units, each player is also recorded in the shard's `rmv` hash (player -> those
-- units; `rmvon`, a string beside it, tells write.lua in the MGET it makes anyway that the hash
-- exists): write.lua answers a result of the player achieved before it `d`, writing nothing,
-- so a retry (or a late result) of before the removal cannot bring the player back. Both keys
-- expire at record_until or later (a later removal only moves it later) and are listed in the index.
-- A later removal pushes the hash's expiry on, so each call also forgets records below
-- forget_before, as they would have expired on their own (Redis 7.0 has no expiry per field): it
-- scans on from where the last call stopped (the marker holds 'c' and the cursor) at least twice as
-- many entries as it records, so a shard with a removal every day keeps a window's worth.
-- With a request, the call is made once per shard and player whatever the retries (a retry of a
-- DELETE whose answer was lost must not remove the results the player posted since): each player
-- is also recorded under `<request> NUL <player>` in the same hash, the value removed_units, with
-- '.1' after them when the player was removed (so the prune above, and write.lua, read it as a
-- number; ids hold no NUL, so it is never a player's field). A call that finds the field changes
-- nothing for that player and answers as the first call did (version -1: the caller finishes the
-- first call's band part, which may have been lost, from the pending record). With `again`, the
-- caller learnt removed_units from another shard's field (the first call did not reach this
-- shard): a period board's entry achieved at or after them (a result posted since, which this
-- shard took for want of a record) stays, with the activity set's entry (and the band rows, when
-- it is the total); older ones go, as the first call would have taken them: a total removed goes
-- from the bands (version, pending, `vrm`) even where a newer entry of another period stays. The
-- field is pruned and expires with the player's record, so past the dedup window a retry removes
-- again, as one without a request does.
-- The inactive cleanup's records (swept): the cleanup records no removal at its own time (a
-- player's results achieved since their last post, a late one too, count at once), but each player
-- it removes at their last post, as shardlb/moderation.py's ``swept_record`` says (best and set
-- boards: 5 minutes on, as a removal's record; incr boards: none, their dedup records refuse
-- replays), so a replay of a result they had (achieved at most 5 minutes past a post) is refused as
-- after a removal. A record below forget_before would be forgotten by the next scan: such a
-- player's last post is over a window old, and so is every first post of a result of theirs, whose
-- replay is past the dedup window already. The entry is marked `w` (its `k` may name only some of
-- its players, or none), and its pointers (below) keep the cleanup's own units.
-- On a journaled board each player recorded also has `NUL <player>` in the hash: the id of the
-- delete entry that last removed them there (below). A later removal that finds the player gone
-- reads that entry alone to archive it (shardlb/moderation.py, ``_delete_entries``), not the journal
-- (unless that entry's `a` names the player: it then reads the journal for their earlier ones).

local base = string.sub(KEYS[2], 1, -5)  -- a reshard's marker, as in write.lua
local move = redis.call('GET', base .. 'mv')
if move and (move ~= 't' or redis.call('EXISTS', base .. 'seal') == 1) then
  return redis.error_reply('BOARDMOVED this board is being resharded; retry')
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return redis.error_reply('BOARDGONE this board was deleted')
end
local h = cmsgpack.unpack(ARGV[1])
-- A shard Redis lost alone (its sentinel gone with its slot) would answer "no entry" for a player
-- its rebuild brings back, and record the request so that its retry answers so again
-- (docs/design-notes.md, "A shard lost alone").
if h[17] == 1 and redis.call('EXISTS', base .. 'here') == 0 then
  return redis.error_reply('SHARDLOST ' .. string.format('%d', h[5]) .. ' this shard lost its keys: rebuild it')
end
-- A journaled removal is held to the journal's bounds as write.lua's calls are: at either bound
-- it is refused (JOURNALFULL) before anything changes, and its delete entry's `n` (its players)
-- counts in `logn` like a result. An empty journal sets a drifted count right, as in write.lua.
local counted = base .. 'logn'
local jmax, rmax = h[15] or 0, h[16] or 0
if h[1] == 1 and (jmax > 0 or rmax > 0) then
  local entries = redis.call('XLEN', KEYS[3])
  local full = jmax > 0 and entries >= jmax
  local unarchived = tonumber(redis.call('GET', counted)) or 0
  if entries == 0 then
    if unarchived ~= 0 then redis.call('SET', counted, 0) end
  elseif rmax > 0 and unarchived >= rmax then
    full = true
  end
  if full then
    return redis.error_reply('JOURNALFULL the journal of this shard is at its bound; the archiver is behind')
  end
end
local given = {}
for i = 6, #KEYS do given[KEYS[i]] = true end
for _, name in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if not given[name] and name ~= KEYS[3] and name ~= KEYS[4] and name ~= KEYS[5] then
    return {'stale'}
  end
end

local journal, bands, stale_before = h[1], h[2], h[6]
local sweep = (stale_before > 0 and h[19] and #h[19] == 3) and h[19] or nil
local forget_before = h[11] or -1
local swept = {}  -- the cleanup's players it records (see the header)
local players = cmsgpack.unpack(ARGV[2])
local removed_versions = base .. 'vrm'
local sets = {}
for i = 6, #KEYS do
  if KEYS[i] ~= removed_versions and redis.call('TYPE', KEYS[i])['ok'] == 'zset' then sets[#sets + 1] = KEYS[i] end
end
local floor = (bands > 0) and tonumber(redis.call('GET', base .. 'vfl')) or 0
local removed_at = h[12] and string.format('%d', h[12])
local all_bands = {}
for b = 0, bands - 1 do all_bands[#all_bands + 1] = tostring(b) end
all_bands = table.concat(all_bands, ',')

local removed_units, record_until = h[7] or -1, h[8] or 0
local T, earliest = 2 ^ (h[9] or 0), h[10] == 1
-- The request this call is (h[13]; '' or absent: none) and whether removed_units are an earlier
-- call's of it (h[14] = 1: another shard has its record, so this is a retry; see the header).
local request, since = (removed_units >= 0 and h[13]) or '', h[14] == 1
local record, total = base .. 'rmv', base .. 'total'
local recorded = {}  -- player -> the units of their record
local function period_board(key)  -- a period board's scores are the codec's (not the activity set's)
  local suffix = string.sub(key, #base + 1)
  return suffix == 'total' or (string.sub(suffix, 2, 2) == ':' and string.find('dwm', string.sub(suffix, 1, 1), 1, true) ~= nil)
end
local out, removed, todo, found = {'ok', ''}, {}, {}, {}
local held_periods = {}  -- flat: player, the names of the periods their entry stayed in (`again`)
for _, player in ipairs(players) do
  local first = request ~= '' and redis.call('HGET', record, request .. '\0' .. player)
  if first then  -- this request removed the player here already: answer as it did, change nothing
    out[#out + 1] = string.find(first, '.', 1, true) and 1 or 0
    out[#out + 1] = -1
  else
    todo[#todo + 1] = player
    local go, base_units = true, removed_units
    if stale_before > 0 then
      local seen = redis.call('ZSCORE', KEYS[6], player)
      go = seen ~= false and tonumber(seen) <= stale_before
      if go and sweep then
        base_units = math.min(math.max(0, math.floor((tonumber(seen) + sweep[1]) / sweep[2]) + 1), sweep[3])
      end
    end
    local n, kept, held_total, others, names = 0, false, false, {}, {}
    if go then
      local latest = base_units
      for _, key in ipairs(sets) do
        local score = false
        if base_units >= 0 and period_board(key) then score = redis.call('ZSCORE', key, player) end
        local units = -1
        if score then
          local tp = math.fmod(tonumber(score), T)
          units = earliest and (T - 1 - tp) or tp
        end
        if since and units >= removed_units then  -- achieved since the request's removal: stays
          kept = true
          held_total = held_total or key == total
          names[#names + 1] = string.sub(key, #base + 1)
        elseif not period_board(key) then
          others[#others + 1] = key
        else
          if score and units + 1 > latest then latest = units + 1 end
          n = n + redis.call('ZREM', key, player)
        end
      end
      for _, key in ipairs(others) do  -- the activity set: kept with a result kept
        if not kept then n = n + redis.call('ZREM', key, player) end
      end
      recorded[player] = latest
      if sweep and n > 0 and latest >= forget_before then swept[#swept + 1] = player end
    end
    local version = 0
    -- The band rows follow the total alone: a total removed goes from the bands even where a newer
    -- entry of another period stays (a best board's total of before and a worse result since).
    if go and bands > 0 and not held_total then
      version = redis.call('HINCRBY', KEYS[4], player, 1)
      if version == 1 and floor > 0 then
        version = floor + 1
        redis.call('HSET', KEYS[4], player, string.format('%d', version))
      end
      redis.call('HSET', KEYS[5], player, all_bands)
      redis.call('ZADD', KEYS[1], '+inf', KEYS[4], '+inf', KEYS[5])
      if removed_at then
        redis.call('ZADD', removed_versions, removed_at, player)
        redis.call('ZADD', KEYS[1], '+inf', removed_versions)
      end
    end
    if n > 0 then removed[#removed + 1] = player end
    if n > 0 and #names > 0 then
      held_periods[#held_periods + 1] = player
      held_periods[#held_periods + 1] = table.concat(names, ',')
    end
    found[player] = n > 0
    out[#out + 1] = (n > 0) and 1 or 0
    out[#out + 1] = version
  end
end
if move and #todo > 0 then  -- tracked as a member with no match id: the mover copies the player
  for i = 1, #todo, 1000 do
    local tracked = {}
    for j = i, math.min(i + 999, #todo) do
      tracked[#tracked + 1] = '\0' .. todo[j]
      if request ~= '' then
        tracked[#tracked + 1] = request .. '\0' .. todo[j]
        tracked[#tracked + 1] = '\1' .. request .. '\0' .. todo[j]
      end
    end
    redis.call('SADD', base .. 'chg', unpack(tracked))
  end
end
local records = {}  -- flat: player, units, as recorded (journaled with the delete entry)
local fresh = {}  -- player -> true when the shard held no record of them before this call
-- The inactive cleanup (stale_before) records its players at their last posts (swept, above), and on
-- a journaled board it points at its delete entry for each player it removed (h[18]: the units of
-- those pointers, its own time's, so they live a window from the cleanup; see the end).
local record_at = nil  -- when the record hash expires, once this call set it
local pointed = (journal == 1 and stale_before > 0 and #removed > 0) and (h[18] or -1) or -1
local kept_players = (removed_units >= 0) and todo or swept  -- the players this call records
if (removed_units >= 0 or pointed >= 0 or #swept > 0) and #todo > 0 then
  local marker = base .. 'rmvon'
  local at_units = string.format('%d', removed_units)
  for i = 1, #kept_players, 500 do
    local last = math.min(i + 499, #kept_players)
    local held = redis.call('HMGET', record, unpack(kept_players, i, last))  -- a record never goes back
    local pairs_ = {}
    for j = i, last do
      local player = kept_players[j]
      pairs_[#pairs_ + 1] = player
      local units = math.max(recorded[player] or removed_units, tonumber(held[j - i + 1]) or -1)
      fresh[player] = not held[j - i + 1]
      pairs_[#pairs_ + 1] = string.format('%d', units)
      records[#records + 1] = player
      records[#records + 1] = units
      if request ~= '' then
        pairs_[#pairs_ + 1] = request .. '\0' .. player
        pairs_[#pairs_ + 1] = found[player] and (at_units .. '.1') or at_units
      end
    end
    redis.call('HSET', record, unpack(pairs_))
  end
  local cursor = string.match(redis.call('GET', marker) or '', '^c(%d+)$') or '0'  -- rebuilds set '1'
  if forget_before > 0 then
    local scan = redis.call('HSCAN', record, cursor, 'COUNT', 8 * #todo + 32)  -- up to 4 fields a player
    cursor = scan[1]
    local old = {}
    for i = 1, #scan[2], 2 do
      if tonumber(scan[2][i + 1]) < forget_before then old[#old + 1] = scan[2][i] end
    end
    if #old > 0 then redis.call('HDEL', record, unpack(old)) end
  end
  local until_ms = math.max(record_until, redis.call('PEXPIRETIME', marker))
  local at = string.format('%d', until_ms)
  record_at = at
  redis.call('PEXPIREAT', record, at)
  redis.call('SET', marker, 'c' .. cursor, 'PXAT', at)
  redis.call('ZADD', KEYS[1], at, record, at, marker)
end
if journal == 1 and (#removed > 0 or #records > 0) then
  local k = (#records > 0) and {'k', cmsgpack.pack(records)} or {}
  if #records > 0 and request ~= '' then  -- the request's records too (`q`, `u`: its units)
    k[#k + 1], k[#k + 2], k[#k + 3], k[#k + 4] = 'q', request, 'u', string.format('%d', removed_units)
  end
  if #held_periods > 0 then  -- `a`: the periods each removed player stayed in (see the header)
    k[#k + 1], k[#k + 2] = 'a', cmsgpack.pack(held_periods)
  end
  if stale_before > 0 then  -- `w`: the inactive cleanup's (its `k` may name some players only)
    k[#k + 1], k[#k + 2] = 'w', '1'
  end
  -- the players it names, at least one (a removal asked for records each; the cleanup, some of those
  -- it removed)
  local n = math.max(#records / 2, #removed)
  local count = string.format('%d', n)
  out[2] = redis.call('XADD', KEYS[3], '*', 'b', h[3], 'i', h[4], 's', h[5], 'n', count, 'x', cmsgpack.pack(removed), unpack(k))
  redis.call('ZADD', KEYS[1], '+inf', KEYS[3])
  if redis.call('INCRBY', counted, count) == n then redis.call('ZADD', KEYS[1], '+inf', counted) end
end
-- Where the delete entry that removed a player is (see the header): `NUL <player>` -> the player's
-- record units, '.', then the entry's id as digits (its ms on 13 places, then its sequence), so
-- the prune above and the release before read it as a number. A player removed here points at
-- this entry; one found absent keeps the entry it points at, under its new units (the field is
-- pruned with the player's own record, not before), or, with no record before this call, points at
-- this entry too (no removal of theirs here to look for: it names them in `k` alone). A record
-- without one (the release before's) gets none: the caller reads the journal for it. A rebuild puts
-- these back (shardlb/rebuild.py, ``RetryRecords.named``), as it puts back the records.
-- With a request, `SOH <request> NUL <player>` -> the request's units, '.', this entry's id as
-- digits: where the request's call that recorded the player here journaled (its `q`), which the
-- request sent again reads alone (``_delete_entries``), not the journal by the request's name:
-- the player's own pointer may name an earlier entry (they were gone) or a later one. Request
-- names hold no SOH (moderation.remove), so it is never a request's field; a reshard copies it as
-- one (the part after the NUL), and tracks it beside the request's field.
-- The inactive cleanup points at its entry too, for each player it removed (under h[18]'s units,
-- not its records' older ones), so a removal asked for later that finds them gone archives the
-- cleanup's entry before it is answered (until 2026-12-06 it did not look for it, and a loss of
-- Redis before the archiver's round brought the player back after that answer).
if out[2] ~= '' and (#records > 0 or pointed >= 0) then
  local ms, seq = string.match(out[2], '^(%d+)%-(%d+)$')
  local here = string.rep('0', 13 - #ms) .. ms .. seq
  local positions = {}
  if pointed >= 0 then  -- the cleanup's players, each removed by this entry
    for _, player in ipairs(removed) do
      positions[#positions + 1], positions[#positions + 2] = '\0' .. player, string.format('%d', pointed) .. '.' .. here
      if #positions >= 1000 then
        redis.call('HSET', record, unpack(positions))
        positions = {}
      end
    end
    if #positions > 0 then redis.call('HSET', record, unpack(positions)) end
    positions = {}
    redis.call('PEXPIREAT', record, record_at)  -- the hash may be new: its expiry as set above
  end
  for i = 1, (pointed < 0) and #records or 0, 2 do  -- the cleanup's players point above
    if request ~= '' then  -- where the request's entry is, pruned with its record of the player
      positions[#positions + 1] = '\1' .. request .. '\0' .. records[i]
      positions[#positions + 1] = string.format('%d', removed_units) .. '.' .. here
    end
    local units = string.format('%d', records[i + 1])
    local field = '\0' .. records[i]
    local was = not found[records[i]] and redis.call('HGET', record, field)
    local at = was and string.match(was, '%.(%d+)$')
    if found[records[i]] or (not at and fresh[records[i]]) then at = here end
    if at then positions[#positions + 1], positions[#positions + 2] = field, units .. '.' .. at end
    if #positions >= 1000 then
      redis.call('HSET', record, unpack(positions))
      positions = {}
    end
  end
  if #positions > 0 then redis.call('HSET', record, unpack(positions)) end
end
return out
