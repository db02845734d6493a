-- Apply a batch of results to ONE shard atomically. All KEYS share the shard's hash tag.
--
-- KEYS[1]     the shard's key index (sorted set: key name -> expiry ms, +inf for none)
-- KEYS[2]     the shard's `gone` marker: set when the board was deleted; then nothing is written
-- KEYS[3..]   period boards, dedup and pin buckets, other regions' totals, band bookkeeping
-- ARGV[1]     a stream of MessagePack values (an array's items without its header): mode, time_bits, points_max, order, tiebreak, now_ms,
--             periods_per_result, version key index (0: none), pending key index (0: none),
--             {first, current dedup bucket} ({} for none), {first, current pin bucket} ({} for none),
--             {indices of the other regions' totals a player of this shard could live in},
--             {band start points (band boards)}, {expiry ms of each KEYS[i], 0 = never},
--             journal key index (0: the board keeps no journal), journal bound (entries),
--             board id, incarnation, shard (written into each journal entry),
--             {per dated period key: its index, its frozen marker's index, when it closes (ms), its name}
--             activity key index (0: none; inactive_after boards: player -> last applied post, ms),
--             bucket length (ms), dedup window (ms): a bucket k expires at (k + 1) x length + window,
--             pin span: a pin hash spans that many buckets, named by its first (a multiple of the
--             span), and expires at (first + span) x length + window,
--             items stream: 1 when ARGV[2] is a stream of values, 0 when it is one array,
--             same periods: the first and last time units whose results go to the periods of a
--             result achieved now (lo > hi: none),
--             journal bound (results not yet archived; 0 or absent: none),
--             trim: 1 (or absent) to drop the key index's listings of keys expired by Redis's
--             clock (TIME), 0 to leave them for a later call (the caller asks about once a second a shard),
--             sentinel: 1 when the board's record says its shards carry sentinels (shardlb/store.py,
--             SENTINELS): a shard without its `here` refuses the call (SHARDLOST), nothing applied;
--             0 or absent: not looked at
--             Dedup and pin buckets are not KEYS: their names (<prefix>dd:<k>, <prefix>pin:<k>) are
--             built here from the shard's prefix, the hash tag of every key of the call, as `mv`, `seal`
--             and `chg` are (25 bucket names a call, twice for an incr board, were most of its KEYS).
-- ARGV[2]     flat, per result: player, score, points, time_units, dedup_member, server_time (1
--             when the caller sent no achieved time), <period key indices, total first>. (One packed
--             argument instead of thousands: the client spends most of its time encoding arguments
--             one by one.) A stream of values when they are few enough to come back from one
--             cmsgpack.unpack (a Lua call returns at most 8,000), else one array.
--             Why streams: cmsgpack builds an array by inserting its items one by one, the table
--             growing as it goes, while {cmsgpack.unpack(s)} sizes the table once; the header and
--             the items were a sixth of a small call's instructions (`make bench-lua`).
-- Returns per result: status, total score after, version, pending band moves, skipped periods.
--   status: i improved (the total's entry changed; incr: more points, a new player, or a player of
--             0 points moved to an earlier result's time), u unchanged (applied, the total as it was),
--           d duplicate (an incr result seen in the dedup window, or a
--             result achieved before its player's removal: remove.lua's `rmv`),
--           o overflow (incr past points_max),
--           r region conflict (nothing written; `after` is the player's total in their region, none
--             when only an entry of a period of the result is there: see `held` below),
--           p pinned (nothing written; `after` is the time units this (match, player) was first
--             seen with, outside the header's same periods: the caller sends the result again
--             with that time and its periods; a pin inside them is applied here with its time)
--   version, pending (band boards): the player's version and the comma-separated band indices
--           that may still hold a stale row, when a band move is unfinished; 0 and '-' otherwise.
--   skipped: the comma-separated names of the result's periods it was NOT applied to because they
--           are closed (now >= their close time) or frozen (their marker exists); '' when none,
--           and always '' for a result not applied. The result still counts in its other periods.
-- Journal: every result that was applied (any status but d, o, r, p) is appended, in this same
--   call, to the shard's stream as ONE entry: b board, i incarnation, s shard, r a MessagePack
--   array, flat: dedup_member (match_id NUL player_id), points, time_units per result. So a
--   result is on the board if and only if it is in the journal. When a result of the call skipped
--   a period, the entry also has c: a MessagePack array with each result's `skipped` (as returned),
--   so the journal says exactly which periods each result went into. (x is a delete entry's field:
--   remove.lua's removed players; shardlb/journal.py's decode.) The entry's n is its count
--   of results, and the shard's `logn` counts the results not archived yet: up by n here, down by
--   n in ack.lua when the archiver acknowledges an entry that has n. A journal at either bound
--   (entries, or results not archived) refuses the whole call (JOURNALFULL): nothing is applied,
--   and the caller answers 503. An empty journal has nothing left to archive, so there `logn` is
--   set to 0: a count that drifted (an archiver that acknowledged without counting, a consumer
--   group made again) is right again once the archive catches up.
-- Scores are integers below 2^53, which Lua doubles hold exactly; they are formatted with %d
-- (a C long here) because Lua's default number formatting keeps only 14 digits (%.0f, which this
-- used before, goes through glibc's floating-point printing: 3-7% of a call's instructions).

-- A reshard (shardlb/reshard.py) marks the shard: `mv` 't' tracks every result's dedup member
-- in `chg` (the mover copies those players again); 't' with a live `seal`, 'm' (moved to the new
-- layout) and 'c' (a new layout not open yet) refuse the call, which the caller retries. The marker
-- is read before `gone`: the old layout's keys are reclaimed after a reshard, and a late write must
-- hear "moved", not "deleted".
--
-- The shard's sentinel (`here`, keys.sentinel_key: set when the shard came to exist with its data)
-- missing on a board whose shards carry one means Redis lost this slot and serves it again empty
-- while the registry kept the board: every call is refused (SHARDLOST) until `shardlb rebuild BOARD
-- --shard N` brings the shard back; answered here, a best board's write would say `improved` below
-- the player's real best (docs/design-notes.md, "A shard lost alone").
--
-- The total's frozen marker (set when the board's season is archived: shardlb/settlement.py) closes
-- the shard: every call is refused (BOARDCLOSED), nothing applied, so the archive's check and
-- awards cover every result the board ever took.
--
-- Every marker the call tests (the reshard's `mv` and `seal`, `gone`, the pin span's `pspan`, the
-- total's and each dated period's frozen marker, on a journaled board the journal's `logn`, the
-- removals' `rmvon`, on a band board the version floor `vfl`, and the sentinel `here`) is a string, read in ONE MGET: a
-- command costs a script more than its work here, and a call of one or two results (the usual HTTP
-- batch) paid for seven of them.
local base = string.sub(KEYS[2], 1, -5)
local h = {cmsgpack.unpack(ARGV[1])}
local locks = h[20]
local marks = {base .. 'mv', base .. 'seal', KEYS[2], base .. 'pspan', base .. 'frozen:total'}
for i = 1, #locks, 4 do marks[#marks + 1] = KEYS[locks[i + 1]] end
local counted = base .. 'logn'
local logn_at = 0
if h[15] > 0 then
  marks[#marks + 1] = counted
  logn_at = #marks
end
marks[#marks + 1] = base .. 'rmvon'  -- the shard recorded removals (remove.lua): read `rmv` below
local rmv_at = #marks
local floor_at = 0
if h[8] > 0 then  -- band boards: the highest version forgotten here (`vfl`, BandMoves.prune)
  marks[#marks + 1] = base .. 'vfl'
  floor_at = #marks
end
local here_at = 0
if (h[30] or 0) == 1 then
  marks[#marks + 1] = base .. 'here'
  here_at = #marks
end
local marked = redis.call('MGET', unpack(marks))
local move = marked[1]
if move and (move ~= 't' or marked[2]) then
  return redis.error_reply('BOARDMOVED this board is being resharded; retry')
end
if marked[3] then
  return redis.error_reply('BOARDGONE this board was deleted')
end
if marked[5] then
  return redis.error_reply('BOARDCLOSED this board is closed: its season is being archived')
end
if here_at > 0 and not marked[here_at] then
  return redis.error_reply('SHARDLOST ' .. string.format('%d', h[19]) .. ' this shard lost its keys: rebuild it')
end
local mode, T, pmax, desc, earliest = h[1], 2 ^ h[2], h[3], h[4] == 'desc', h[5] == 'earliest'
local now, P, vk, pendk = h[6], h[7], h[8], h[9]
local dd, pins, rivals, bands, expiry = h[10], h[11], h[12], h[13], h[14]
local jk, jmax, ak = h[15], h[16], h[21] or 0
local bucket_ms, window_ms, pin_span = h[22], h[23], h[24] or 1
local same_lo, same_hi = h[26] or 0, h[27] or -1
local function bucket_names(span, kind)
  local names = {}
  if #span == 2 then
    for k = span[1], span[2] do names[#names + 1] = base .. kind .. string.format('%d', k) end
  end
  return names
end
-- The current buckets this call wrote to: name -> expiry ms (registered in the index at the end).
local written_buckets = {}
local function wrote_bucket(span, names)
  written_buckets[names[#names]] = (span[2] + 1) * bucket_ms + window_ms
end
local rmax = h[28] or 0
local version_floor = (floor_at > 0) and tonumber(marked[floor_at]) or 0
if jk > 0 then
  local entries = redis.call('XLEN', KEYS[jk])
  local full = entries >= jmax
  if not full and rmax > 0 then
    local unarchived = tonumber(marked[logn_at]) or 0
    if entries == 0 then
      if unarchived ~= 0 then redis.call('SET', counted, 0) end
    else
      full = unarchived >= rmax
    end
  end
  if full then
    return redis.error_reply('JOURNALFULL the journal of this shard is at its bound; the archiver is behind')
  end
end
local ddn = bucket_names(dd, 'dd:')
-- Dedup records are looked up in the bucket after the current one too: a router whose clock is
-- ahead of this caller's (by up to a bucket) may have filed a result there, past a bucket's start
-- this caller has not reached yet; its retry through here must still be a duplicate. Only looked
-- up: this call files its own records in the current bucket, ddn[#ddn].
local dd_seen = ddn
if #ddn > 0 then
  dd_seen = {unpack(ddn)}
  dd_seen[#dd_seen + 1] = base .. 'dd:' .. string.format('%d', dd[2] + 1)
end
-- Pin hashes: each spans pin_span buckets and is named by its first, so a new result is looked up
-- in the window's few spans. Hashes written with another span (1, before there was a span) may
-- still hold pins of the window: the shard's `pspan` marker ("<span>:<bucket>") says from which
-- bucket on every pin went to a hash of this span. Below that bucket each bucket's own name is
-- read too, so those pins are found until they expire. A shard with another span in its marker, or
-- without a marker but with pin hashes in its key index (written before there was a span, or copied
-- by a reshard), sets it to one window past the current bucket: a router of the former version
-- still writing during a rolling upgrade is covered for that long. A shard with no pin hash at all
-- (a new board) has nothing to look up by bucket: its marker says so from the start.
local pinn, pin_home, pin_expiry = {}, nil, 0
if #pins == 2 then
  local first, now_bucket = pins[1], pins[2]
  local marker = base .. 'pspan'
  local mark = marked[4]
  local span, legacy = nil, nil
  if mark then
    local i = string.find(mark, ':', 1, true)
    span, legacy = tonumber(string.sub(mark, 1, i - 1)), tonumber(string.sub(mark, i + 1))
  end
  if span ~= pin_span then
    local others = span ~= nil
    if not others then  -- once per shard: are there pin hashes of before?
      for _, name in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
        if string.sub(name, #base + 1, #base + 4) == 'pin:' then others = true break end
      end
    end
    legacy = others and (now_bucket + math.floor(window_ms / bucket_ms)) or 0
    redis.call('SET', marker, string.format('%d:%d', pin_span, legacy))
    written_buckets[marker] = 0
  end
  for k = first - first % pin_span, now_bucket, pin_span do
    pinn[#pinn + 1] = base .. 'pin:' .. string.format('%d', k)
  end
  for k = first, math.min(legacy - 1, now_bucket) do
    if k % pin_span ~= 0 then pinn[#pinn + 1] = base .. 'pin:' .. string.format('%d', k) end
  end
  local start = now_bucket - now_bucket % pin_span
  -- In a span's last bucket the next span's hash is looked up too (never written here), as dedup
  -- looks in the next bucket: a router whose clock is ahead, past the next span's start, pins there.
  if (now_bucket + 1) % pin_span == 0 then
    pinn[#pinn + 1] = base .. 'pin:' .. string.format('%d', start + pin_span)
  end
  pin_home = base .. 'pin:' .. string.format('%d', start)
  pin_expiry = (start + pin_span) * bucket_ms + window_ms
end
local journal, journal_skips, skips = {}, {}, false
-- A closed or frozen period takes no result, whatever the result's time: decided once per call.
local shut, period_name, any_shut = {}, {}, false
for i = 1, #locks, 4 do
  local k = locks[i]
  period_name[k] = locks[i + 3]
  shut[k] = now >= locks[i + 2] or marked[5 + (i + 3) / 4] ~= false
  any_shut = any_shut or shut[k]
end
local none = {}
local ndd = #ddn
local items = (h[25] == 1) and {cmsgpack.unpack(ARGV[2])} or cmsgpack.unpack(ARGV[2])
local pos = 1
local tmax = T - 1

local function fmt(x) return string.format('%d', x) end
local function split(score)
  local pp = math.floor(score / T)
  local tp = score - pp * T
  local points = desc and pp or (pmax - pp)
  local units = earliest and (tmax - tp) or tp
  return points, units
end
local function join(points, units)
  local pp = desc and points or (pmax - points)
  local tp = earliest and (tmax - units) or units
  return pp * T + tp
end
local function zscore(key, member)
  local s = redis.call('ZSCORE', key, member)
  if s then return tonumber(s) end
  return nil
end
-- Whether another region's shard (rivals: their totals' KEYS) holds `player` in a dated period of
-- the result (its keys KEYS[pk[at + 2 .. at + n]]). The rivals' period keys are named from their
-- totals' prefixes, as the dedup buckets are named here: every shard a player can live in shares
-- this call's hash tag (shardlb/sharding.py). Only asked for a player new to this shard and
-- without a total anywhere, so a regular player's result costs nothing more.
local function held_elsewhere(player, pk, at, n)
  for i = 1, #rivals do
    local other = string.sub(KEYS[rivals[i]], 1, -6)  -- the rival's prefix: its total's name less `total`
    for j = 2, n do
      if redis.call('ZSCORE', other .. string.sub(KEYS[pk[at + j]], #base + 1), player) then return true end
    end
  end
  return false
end
local function band_of(score)
  local points = split(score)
  local b = 0
  for i = 1, #bands do
    if bands[i] <= points then b = i - 1 end
  end
  return b
end

-- Who is already in the window's buckets, asked once per call: one HMGET (pins) or SMISMEMBER
-- (incr dedup) per bucket, naming every member of the call that needs it, where one HGET or
-- SISMEMBER per bucket and per result made a timeless result cost 25 commands (most of a call's
-- time). A lone member takes the single-member command, and the search stops once every member is
-- found. What this call records is added to the same tables as the loop goes, so a member that
-- comes twice in one call sees its first occurrence, as it did when each lookup went to Redis.
local stride = 6 + P
local function already(names, wanted, one, many)
  local found, list, chunk = {}, {}, 1000  -- unpack has a bound on its values
  for i = 1, #items, stride do
    local m = items[i + 4]
    if wanted(i) and found[m] == nil then found[m] = false list[#list + 1] = m end
  end
  local left = #list
  for _, name in ipairs(names) do
    if left == 0 then break end
    if #list == 1 then
      local v = redis.call(one, name, list[1])
      if v and v ~= 0 then found[list[1]] = tonumber(v) left = 0 end
    else
      for first = 1, #list, chunk do
        local last = math.min(first + chunk - 1, #list)
        local got = redis.call(many, name, unpack(list, first, last))
        for j = first, last do
          local v = got[j - first + 1]
          if found[list[j]] == false and v and v ~= 0 then found[list[j]] = tonumber(v) left = left - 1 end
        end
      end
    end
  end
  return found
end
-- Players removed within the dedup window (remove.lua's `rmv`: player -> the removal's time
-- units), read only when the shard has such a record: a result of theirs achieved before the
-- removal's time unit is a duplicate (a retry, or a result of before that comes late), nothing
-- written. One of the removal's own unit (its second, at resolution s) counts: a new result is never
-- taken for an old one.
local removed_at = {}
if marked[rmv_at] then
  local list, seen = {}, {}
  for i = 1, #items, stride do
    local p = items[i]
    if not seen[p] then seen[p] = true list[#list + 1] = p end
  end
  for first = 1, #list, 1000 do
    local last = math.min(first + 999, #list)
    local got = redis.call('HMGET', base .. 'rmv', unpack(list, first, last))
    for j = first, last do
      local v = got[j - first + 1]
      if v then removed_at[list[j]] = tonumber(v) end
    end
  end
end
local pinned_at = (#pinn > 0) and already(pinn, function(i) return items[i + 5] == 1 end, 'HGET', 'HMGET') or {}
local deduped = (ndd > 0) and already(dd_seen, function() return true end, 'SISMEMBER', 'SMISMEMBER') or {}

local touched = {}
local out = {}
local new_pins = {}
while pos <= #items do
  local player, score = items[pos], items[pos + 1]
  local score_text = fmt(score)
  local points, units, member, server_time = items[pos + 2], items[pos + 3], items[pos + 4], items[pos + 5]
  -- The result's period keys are pk[at + 1 .. at + n]: its own slice of items, unless a period of
  -- the call is shut (then a table of those still open, and the names of the others).
  local pk, at, n, skipped = items, pos + 5, P, none
  if any_shut then
    pk, at, skipped = {}, 0, {}
    for j = 1, P do
      local k = items[pos + 5 + j]
      if shut[k] then skipped[#skipped + 1] = period_name[k] else pk[#pk + 1] = k end
    end
    n = #pk
  end
  pos = pos + 6 + P
  local total = KEYS[pk[at + 1]]
  local before = zscore(total, player)
  local status = 'u'
  local after = before

  -- A player already on this shard lives nowhere else; a new one may live in another region.
  -- `held`: no other region has their total, but one holds an entry of a period of this result
  -- (a removal at an earlier call's time takes a best total of before and keeps a period's entry
  -- achieved since, remove.lua's `again`): the result would give them a second entry there.
  local elsewhere, held = nil, false
  if before == nil then
    for i = 1, #rivals do
      elsewhere = zscore(KEYS[rivals[i]], player)
      if elsewhere then break end
    end
    if elsewhere == nil then held = held_elsewhere(player, pk, at, n) end
  end
  -- A result sent without a time is pinned to the first server time it was seen with, so its
  -- retries land in the same periods with the same time. A pin whose time goes to the same
  -- periods as now (same_lo..same_hi: a retry of the same day, as most are) is applied here with
  -- that time, when the result's own keys are also now's (its units in that range: a router
  -- prepares a result when its request comes, and may call later, past a midnight); another is
  -- answered `p`, and the caller sends it again with its time's periods.
  local pinned = nil
  if elsewhere == nil and not held and server_time == 1 then
    pinned = pinned_at[member] or nil
    if pinned == nil then
      new_pins[#new_pins + 1] = member  -- written in one HSET after the loop
      new_pins[#new_pins + 1] = units
      pinned_at[member] = units
    elseif pinned == units then
      pinned = nil
    elseif pinned >= same_lo and pinned <= same_hi and units >= same_lo and units <= same_hi then
      units, score, pinned = pinned, join(points, pinned), nil
      score_text = fmt(score)
    end
  end

  local removed = removed_at[player]
  if elsewhere or held then  -- held: no total there, `after` is none
    status, after = 'r', elsewhere
  elseif pinned then
    status, after = 'p', pinned
  elseif removed and units < removed then
    status = 'd'
  elseif mode == 'best' then
    if before == nil or score > before then
      status, after = 'i', score
    end
    -- The total needs no ZADD when the score does not beat it (most results of a regular player);
    -- period boards may hold less than the total, so each gets its ZADD GT.
    for j = (status == 'i') and 1 or 2, n do
      redis.call('ZADD', KEYS[pk[at + j]], 'GT', score_text, player)
      touched[pk[at + j]] = true
    end
  elseif mode == 'set' then
    for j = 1, n do
      local key = KEYS[pk[at + j]]
      local old = (j == 1) and before or zscore(key, player)
      local replace = old == nil
      if not replace then
        local _, old_units = split(old)
        replace = units > old_units or (units == old_units and score > old)
      end
      if replace then
        redis.call('ZADD', key, score_text, player)
        touched[pk[at + j]] = true
        if j == 1 then
          after = score
          if score ~= old then status = 'i' end
        end
      end
    end
  else
    if deduped[member] then
      status = 'd'
    else
      -- Per key, the sum at the latest time among the results that scored; a player with nothing
      -- scored yet (sum 0) is at the earliest of their results. So a 0-point result changes no
      -- entry that has points (no ZADD), and the outcome does not depend on arrival order
      -- (docs/design-notes.md, "Writes"). new[j] nil: key j stays as it is.
      local new = {}
      for j = 1, n do
        local old = (j == 1) and before or zscore(KEYS[pk[at + j]], player)
        local op, ou = 0, units
        if old ~= nil then op, ou = split(old) end
        if op + points > pmax then status = 'o' break end
        if old == nil or (op == 0 and (points > 0 or units < ou)) then
          new[j] = join(points, units)
        elseif points > 0 then
          new[j] = join(op + points, math.max(ou, units))
        end
      end
      if status ~= 'o' then
        for j = 1, n do
          if new[j] then
            redis.call('ZADD', KEYS[pk[at + j]], fmt(new[j]), player)
            touched[pk[at + j]] = true
          end
        end
        after = new[1] or before
        redis.call('SADD', ddn[ndd], member)
        deduped[member] = 1
        wrote_bucket(dd, ddn)
        if after ~= before then status = 'i' end
      end
    end
  end

  -- Band boards: every change of the total is a move to finish on the band shards. It stays
  -- recorded here (pending) until the caller confirms every band shard took it, so a lost band
  -- call is finished by the next write of the player, a retry, or a repair pass. A player without
  -- a version (new, or removed long ago and forgotten: shardlb/bands.py, BandMoves.prune) starts
  -- above the highest version forgotten on this shard, so above any a band may still hold of them.
  local version, pending = 0, '-'
  if vk > 0 and status ~= 'r' and status ~= 'p' then
    local p = redis.call('HGET', KEYS[pendk], player)
    if after ~= before then
      version = redis.call('HINCRBY', KEYS[vk], player, 1)
      if version == 1 and version_floor > 0 then
        version = version_floor + 1
        redis.call('HSET', KEYS[vk], player, fmt(version))
      end
      touched[vk] = true
      p = p or ''
      if before ~= nil then
        local old = tostring(band_of(before))
        if old ~= tostring(band_of(after)) and not string.find(',' .. p .. ',', ',' .. old .. ',', 1, true) then
          p = (p == '') and old or (p .. ',' .. old)
        end
      end
      redis.call('HSET', KEYS[pendk], player, p)
      touched[pendk] = true
      pending = p
    elseif p then
      version = tonumber(redis.call('HGET', KEYS[vk], player))
      pending = p
    end
  end
  local applied = status ~= 'd' and status ~= 'o' and status ~= 'r' and status ~= 'p'
  local closed = (applied and #skipped > 0) and table.concat(skipped, ',') or ''
  if ak > 0 and applied then
    redis.call('ZADD', KEYS[ak], 'GT', now, player)
    touched[ak] = true
  end
  if jk > 0 and applied then
    journal[#journal + 1] = member
    journal[#journal + 1] = points
    journal[#journal + 1] = units
    journal_skips[#journal_skips + 1] = closed
    skips = skips or closed ~= ''
  end
  out[#out + 1] = status
  out[#out + 1] = (after == score and score_text) or (after and fmt(after)) or ''
  out[#out + 1] = version
  out[#out + 1] = pending
  out[#out + 1] = closed
end

for first = 1, #new_pins, 1000 do  -- in chunks: unpack has a bound on its values
  redis.call('HSET', pin_home, unpack(new_pins, first, math.min(first + 999, #new_pins)))
  written_buckets[pin_home] = pin_expiry
end
if move then  -- every result's member, in chunks (unpack has a bound on its values)
  local tracked = {}
  for i = 1, #items, stride do
    tracked[#tracked + 1] = items[i + 4]
    if #tracked == 1000 then redis.call('SADD', base .. 'chg', unpack(tracked)) tracked = {} end
  end
  if #tracked > 0 then redis.call('SADD', base .. 'chg', unpack(tracked)) end
end
if #journal > 0 then
  local x = skips and {'c', cmsgpack.pack(journal_skips)} or {}
  local n = #journal / 3
  local count = fmt(n)  -- as text: a Lua number goes to Redis through printf's %.14g, dearer
  redis.call('XADD', KEYS[jk], '*', 'b', h[17], 'i', h[18], 's', h[19], 'n', count, 'r', cmsgpack.pack(journal), unpack(x))
  touched[jk] = true
  -- listed in the index when it is made (it lives as long as the board; a value of n means it was
  -- 0 before, which only a new key or one set right below is: listing it again is harmless)
  if redis.call('INCRBY', counted, count) == n then written_buckets[counted] = 0 end
end
-- Every key written is listed in the index with its expiry, in ONE ZADD.
local listed = {}
local function list(name, expire_at)  -- 0: kept while the board lives
  if expire_at > 0 then
    redis.call('PEXPIREAT', name, fmt(expire_at))
    listed[#listed + 1] = fmt(expire_at)
  else
    listed[#listed + 1] = '+inf'
  end
  listed[#listed + 1] = name
end
for i, _ in pairs(touched) do list(KEYS[i], expiry[i]) end
for name, expire_at in pairs(written_buckets) do list(name, expire_at) end
if #listed > 0 then redis.call('ZADD', KEYS[1], unpack(listed)) end
-- Listings of expired keys, dropped about once a second (the caller's choice): a listing that stays
-- a while names a key that no longer exists, which every reader of the index takes in its stride
-- (a drop unlinks nothing, a reshard copies nothing), and the command was 6% of a call of one result.
-- Expired by Redis's clock, the one that expires the keys, not the router's `now`: a router whose
-- clock ran ahead dropped the listings of keys still alive for that long, which a deletion or a
-- reshard (both go by the index) then missed (until 2026-12-05).
if (h[29] or 1) ~= 0 then
  local t = redis.call('TIME')
  local ms = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ms)
end
return out
