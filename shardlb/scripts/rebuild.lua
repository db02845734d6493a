-- A rebuild's steps on ONE shard (shardlb/rebuild.py). All KEYS share the shard's hash tag.
--
-- KEYS[1] the shard's key index, KEYS[2] its `gone` marker, KEYS[3] its journal,
-- KEYS[4..]  pairs (target, live): the key results are applied to, and the period board it becomes
-- ARGV[1]    'mark', 'swap', 'apply', 'start' or 'recall'
--   mark:  returns {last-generated journal id ('0-0' for no journal), id of its first entry ('' for
--          none: the archiver trims the journal from the start), TIME seconds, TIME micros}
--   swap:  if a target's size (ZCARD, HLEN for a hash; 0 when it does not exist) is not its `size`
--          in ARGV[2], UNLINK every target and return {'lost', last-generated id}: the caller fills
--          them again. Else if the journal's last-generated id is still `expected` (or `force` is
--          1): apply ARGV[3]'s results to the targets, then RENAME every target that exists over
--          its live key (and UNLINK a live key whose target does not exist: filled with nobody),
--          registering each in the key index with its expiry as write.lua does, and set the
--          shard's swap marker (`swap`) to ARGV[2]'s `mark` for `marker ms` (listed in the key
--          index; with no mark it is unlinked). Otherwise change nothing. Returns {'ok' or 'moved',
--          last-generated id}.
--   apply: first, when the swap marker is not `mark` (the forced swap it follows was lost in a
--          failover, or another swap came since), return {'unswapped', last-generated id},
--          changing nothing: its results are on the board that swap replaced already, or would be
--          applied on top of another rebuild's. Then apply ARGV[3]'s results to the targets (the
--          live keys themselves) and register them, and unlink the marker (an apply made again
--          finds none: made once),
--          leaving out the players of ARGV[2]'s `left` and of the delete entries journaled after
--          `expected` (a removal since wiped them on the live keys; their results would come back),
--          but in the periods each such removal left whole (a delete entry's `a`, remove.lua; `left`'s
--          names), which held the player's entry when it was made: results and removal items apply there.
--          Unless `force` is 1, first return {'moved', last-generated id}, changing nothing, when an
--          entry after `expected` may have been trimmed (no entry at or before it is left, and the
--          journal has moved past it: the caller reads it from PostgreSQL), or when a player that a
--          removal item (pair number 0 or below) names has results journaled after `expected` (its
--          ZREM would wipe them: the caller sends them with it).
--   start: ARGV[2] an id: unless the journal's last-generated id is that id or after it, it is
--          made that id (XSETID; the entries the journal holds stay), so its next ids are past it.
--          A journal that does not exist is made, empty (an entry of that id added and trimmed at
--          once, as the reshard starts a new layout's journals, its count of entries added then
--          put back to 0) and listed in the key index. Returns {'started', the id} or {'past', the
--          journal's last-generated id}: made again, it changes nothing.
--   recall: put back retry records of the dedup window (shardlb/rebuild.py, `RetryRecords`): KEYS[4]
--          the shard's pin marker (`pspan`), KEYS[5..] dedup sets (`dd:<k>`), pin hashes
--          (`pin:<k>`), the removals hash (`rmv`: the latest removal of each player kept, its
--          expiry never made sooner, and its marker `rmvon` set beside it; a removal request's
--          record, and where a removal's delete entry is (remove.lua's NUL fields), whose values
--          are text, with HSETNX) and the activity set
--          (`seen`: ZADD GT, no expiry). ARGV[2] MessagePack: pin span (0 when the call holds no
--          pin), {per key from KEYS[5]: 1 for a pin hash, 2 for the removals hash, 3 for the
--          activity set, 0 for a dedup set}, {per key from KEYS[5]: its expiry ms, 0 for none};
--          ARGV[3] MessagePack, flat: per record, its key's number (1 for KEYS[5]), dedup member
--          (match_id NUL player_id; the player for the activity set), time units (pins; the
--          arrival ms for the activity set). SADD, or HSETNX (a pin write.lua made since is the one
--          the shard has answered with: it stays), then each key's expiry and its listing in the key
--          index as write.lua sets them. A shard without a pin marker and without pin hashes gets
--          the marker write.lua gives a new board ("<span>:0"); with pin hashes of before it is left
--          to write.lua (one window past). Returns {'ok', ''}.
-- ARGV[2]    MessagePack: mode, time_bits, points_max, order, tiebreak, expected id, force,
--            {expiry ms of each pair's live key, 0 = never}, {size of each pair's target as filled
--            (swap; -1 for apply)}, {`left` (apply), flat: per player removed since the swap, the
--            names of the periods every such removal left whole, comma-separated ('': none)},
--            mark (swap, apply: a token of the swap, '' for none), marker ms (swap: how long the
--            marker lives)
-- ARGV[3]    MessagePack, flat: per result and period, player, score, points, time_units, pair number;
--            pair number 0 removes the player from every target (a removal, shardlb/moderation.py),
--            a negative one -n from the n-th pair's target alone (a removal that left others whole)
-- The results are applied with write.lua's rules (best: the higher score; set: the later time, ties
-- by score; incr: the sum, at the latest time among the results that scored, or the earliest while
-- none has). They were journaled and counted once already, so there
-- is no dedup, overflow check, band bookkeeping or journaling here.

local function last_id(key)
  if redis.call('EXISTS', key) == 0 then return '0-0' end
  local info = redis.call('XINFO', 'STREAM', key)
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then return info[i + 1] end
  end
  return '0-0'
end

-- Whether stream id a is before stream id b ('<ms>-<seq>', as Redis spells them: no leading zeros),
-- compared as text: a sequence number can be past what a Lua number holds exactly.
local function id_before(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  local function less(x, y)
    if #x ~= #y then return #x < #y end
    return x < y
  end
  if am ~= bm then return less(am, bm) end
  return less(as, bs)
end

local op = ARGV[1]
if op == 'mark' then
  local first = redis.call('XRANGE', KEYS[3], '-', '+', 'COUNT', 1)
  local t = redis.call('TIME')
  return {last_id(KEYS[3]), first[1] and first[1][1] or '', t[1], t[2]}
end

local npairs = (#KEYS - 3) / 2
if redis.call('EXISTS', KEYS[2]) == 1 then
  if op == 'swap' then
    for i = 1, npairs do redis.call('UNLINK', KEYS[2 + 2 * i]) end
  end
  return redis.error_reply('BOARDGONE this board was deleted')
end
-- A reshard's marker or seal on the shard (shardlb/reshard.py: tracked, sealed, moved away, or a new
-- shard not open yet): what this call would write is a change the reshard never copies, or one on
-- a layout it is leaving. Refused, as write.lua refuses, whatever the caller read of the registry.
local base = string.sub(KEYS[2], 1, -5)
if redis.call('EXISTS', base .. 'mv', base .. 'seal') > 0 then
  if op == 'swap' then
    for i = 1, npairs do redis.call('UNLINK', KEYS[2 + 2 * i]) end
  end
  return redis.error_reply('BOARDMOVED this board is being resharded; retry')
end

if op == 'start' then
  -- The journal's last-generated id moved up to ARGV[2] (XSETID), never back: the next ids are past
  -- it. A journal that does not exist is made empty, with an entry of that id added and trimmed at
  -- once and its count of entries added put back to 0 (none was), and listed in the key index as
  -- write.lua lists it. The entries a journal holds stay (XSETID trims nothing).
  local last = last_id(KEYS[3])
  if not id_before(last, ARGV[2]) then return {'past', last} end
  if redis.call('EXISTS', KEYS[3]) == 1 then
    redis.call('XSETID', KEYS[3], ARGV[2])
  else
    redis.call('XADD', KEYS[3], 'MAXLEN', '0', ARGV[2], 'start', '1')
    redis.call('XSETID', KEYS[3], ARGV[2], 'ENTRIESADDED', 0)
  end
  redis.call('ZADD', KEYS[1], '+inf', KEYS[3])
  return {'started', ARGV[2]}
end

if op == 'recall' then
  local h = cmsgpack.unpack(ARGV[2])
  local span, pin, expiry = h[1], h[2], h[3]
  if span > 0 and redis.call('EXISTS', KEYS[4]) == 0 then
    local base, others = string.sub(KEYS[2], 1, -5), false
    for _, name in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
      if string.sub(name, #base + 1, #base + 4) == 'pin:' then others = true break end
    end
    if not others then
      redis.call('SET', KEYS[4], string.format('%d:0', span))
      redis.call('ZADD', KEYS[1], '+inf', KEYS[4])
    end
  end
  local items = cmsgpack.unpack(ARGV[3])
  for pos = 1, #items, 3 do
    local i = items[pos]
    if pin[i] == 1 then
      redis.call('HSETNX', KEYS[4 + i], items[pos + 1], items[pos + 2])
    elseif pin[i] == 2 and type(items[pos + 2]) == 'string' then  -- a removal request's record: the first
      redis.call('HSETNX', KEYS[4 + i], items[pos + 1], items[pos + 2])
    elseif pin[i] == 2 then  -- a removal (remove.lua's `rmv`): the latest of a player's kept
      local held = redis.call('HGET', KEYS[4 + i], items[pos + 1])
      if not held or tonumber(held) < items[pos + 2] then
        redis.call('HSET', KEYS[4 + i], items[pos + 1], items[pos + 2])
      end
    elseif pin[i] == 3 then  -- the activity set (write.lua's `seen`): a later post's time stays
      redis.call('ZADD', KEYS[4 + i], 'GT', string.format('%d', items[pos + 2]), items[pos + 1])
    else
      redis.call('SADD', KEYS[4 + i], items[pos + 1])
    end
  end
  local listed = {}
  for i = 1, #KEYS - 4 do
    local until_ms = expiry[i]
    if pin[i] == 2 then  -- never sooner than it is (a removal meanwhile), and its marker with it
      until_ms = math.max(until_ms, redis.call('PEXPIRETIME', KEYS[4 + i]))
      local marker = string.sub(KEYS[2], 1, -5) .. 'rmvon'
      redis.call('SET', marker, '1', 'PXAT', string.format('%d', until_ms))
      listed[#listed + 1] = string.format('%d', until_ms)
      listed[#listed + 1] = marker
    end
    local at = string.format('%d', until_ms)
    if until_ms == 0 then  -- kept while the board lives (the activity set), as write.lua lists it
      at = '+inf'
    else
      redis.call('PEXPIREAT', KEYS[4 + i], at)
    end
    listed[#listed + 1] = at
    listed[#listed + 1] = KEYS[4 + i]
  end
  if #listed > 0 then redis.call('ZADD', KEYS[1], unpack(listed)) end
  return {'ok', ''}
end

local h = cmsgpack.unpack(ARGV[2])
local mode, T, pmax, desc, earliest = h[1], 2 ^ h[2], h[3], h[4] == 'desc', h[5] == 'earliest'
local expected, force, expiry, sizes, left = h[6], h[7], h[8], h[9], h[10] or {}
local mark, marker = h[11] or '', string.sub(KEYS[2], 1, -5) .. 'swap'
local tmax = T - 1
local last = last_id(KEYS[3])
-- An apply follows the forced swap that set the marker, on the same primary. A failover in between
-- can lose the swap, the marker with it, and leave the board as it was before it: the results this
-- apply carries are on that board already (an incr board would count them twice). Checked here, in
-- the call that writes, so nothing comes between the check and the apply.
if op == 'apply' and (mark == '' or redis.call('GET', marker) ~= mark) then
  return {'unswapped', last}
end
-- Every target as filled before any is renamed. The fill is acknowledged by the master alone: a
-- failover between the fill and this call can promote a replica that has none of it, or a prefix
-- of its commands (so a short count), while the journal still says nothing moved; an expired
-- target (its TTL) is short too. A missing target would unlink a live board that has players.
if op == 'swap' then
  local lost = false
  for i = 1, npairs do
    local target = KEYS[2 + 2 * i]
    local kind, size = redis.call('TYPE', target)['ok'], 0
    if kind == 'zset' then size = redis.call('ZCARD', target)
    elseif kind == 'hash' then size = redis.call('HLEN', target) end
    if size ~= sizes[i] then lost = true end
  end
  if lost then
    for i = 1, npairs do redis.call('UNLINK', KEYS[2 + 2 * i]) end
    return {'lost', last}
  end
end
if op == 'swap' and last ~= expected and force == 0 then
  return {'moved', last}
end
-- apply after a forced swap: what was written since `expected` is on the live keys already, and a
-- removal among it wiped its player there: that player's results (from before it) are not put back,
-- but in the periods it left whole (remove.lua's `a`: a removal made at an earlier call's time keeps
-- the entries achieved since), which held them when it was made. `cut`: player -> true (wiped from
-- every period) or the set of the period names every such removal left whole.
local items = cmsgpack.unpack(ARGV[3])
local cut = {}
local function cut_from(player, kept)  -- kept: the names, comma-separated ('' or nil: none)
  local before = cut[player]
  if before == true then return end
  if kept == nil or kept == '' then
    cut[player] = true
    return
  end
  local set = {}
  for name in string.gmatch(kept, '[^,]+') do
    if before == nil or before[name] then set[name] = true end
  end
  cut[player] = next(set) and set or true
end
local pair_names = {}  -- each pair's period name: its live key after the shard's prefix
for i = 1, npairs do pair_names[i] = string.sub(KEYS[3 + 2 * i], #base + 1) end
local function alone(player, i)  -- whether the apply leaves the player's entry of pair i as it is
  local c = cut[player]
  return c == true or (c ~= nil and not c[pair_names[i]])
end
for pos = 1, #left, 2 do cut_from(left[pos], left[pos + 1]) end
if op == 'apply' and last ~= expected then
  if force == 0 and #redis.call('XRANGE', KEYS[3], '-', expected, 'COUNT', 1) == 0 then
    return {'moved', last}  -- trimmed up to `expected` at least: what came after may be gone
  end
  local zrem = {}
  for pos = 1, #items, 5 do
    if items[pos + 4] <= 0 then zrem[items[pos]] = true end
  end
  for _, entry in ipairs(redis.call('XRANGE', KEYS[3], '(' .. expected, '+')) do
    local fields = entry[2]
    local gone, kept = nil, {}
    for i = 1, #fields, 2 do
      if fields[i] == 'x' then  -- a delete entry (remove.lua): the players it removed
        gone = cmsgpack.unpack(fields[i + 1])
      elseif fields[i] == 'a' then  -- ... and the periods it left whole, per player
        local held = cmsgpack.unpack(fields[i + 1])
        for n = 1, #held, 2 do kept[held[n]] = held[n + 1] end
      elseif fields[i] == 'r' and force == 0 and next(zrem) then  -- results: (match NUL player, points, units)
        local applied = cmsgpack.unpack(fields[i + 1])
        for n = 1, #applied, 3 do
          local player = string.match(applied[n], '%z(.*)$')
          if zrem[player] and cut[player] ~= true then return {'moved', last} end
        end
      end
    end
    for _, player in ipairs(gone or {}) do cut_from(player, kept[player]) end
  end
end

local function fmt(x) return string.format('%.0f', x) end
local function split(score)
  local pp = math.floor(score / T)
  local tp = score - pp * T
  return desc and pp or (pmax - pp), earliest and (tmax - tp) or tp
end
local function join(points, units)
  local pp = desc and points or (pmax - points)
  local tp = earliest and (tmax - units) or units
  return pp * T + tp
end

for pos = 1, #items, 5 do
  local player, score, points, units = items[pos], items[pos + 1], items[pos + 2], items[pos + 3]
  if items[pos + 4] == 0 then
    for i = 1, npairs do
      if not alone(player, i) then redis.call('ZREM', KEYS[2 + 2 * i], player) end
    end
  elseif items[pos + 4] < 0 then
    if not alone(player, -items[pos + 4]) then redis.call('ZREM', KEYS[2 - 2 * items[pos + 4]], player) end
  elseif alone(player, items[pos + 4]) then  -- removed there since the forced swap (see `cut`)
  else
    local key = KEYS[2 + 2 * items[pos + 4]]
    local s = redis.call('ZSCORE', key, player)
    local old = nil
    if s then old = tonumber(s) end
    local new = nil
    if mode == 'best' then
      if old == nil or score > old then new = score end
    elseif mode == 'set' then
      local _, old_units = 0, 0
      if old ~= nil then _, old_units = split(old) end
      if old == nil or units > old_units or (units == old_units and score > old) then new = score end
    else  -- write.lua's incr rule (the latest time that scored; with 0 points, the earliest)
      local op_, ou = 0, units
      if old ~= nil then op_, ou = split(old) end
      if old == nil or (op_ == 0 and (points > 0 or units < ou)) then
        new = join(points, units)
      elseif points > 0 then
        new = join(op_ + points, math.max(ou, units))
      end
    end
    if new ~= nil then redis.call('ZADD', key, fmt(new), player) end
  end
end

for i = 1, npairs do
  local target, live = KEYS[2 + 2 * i], KEYS[3 + 2 * i]
  local present = redis.call('EXISTS', target) == 1
  if op == 'swap' and present and target ~= live then
    redis.call('RENAME', target, live)
  elseif op == 'swap' and not present then
    redis.call('UNLINK', live)
    redis.call('ZREM', KEYS[1], live)
  end
  if present then
    if expiry[i] > 0 then
      redis.call('PEXPIREAT', live, expiry[i])
      redis.call('ZADD', KEYS[1], expiry[i], live)
    else
      redis.call('PERSIST', live)
      redis.call('ZADD', KEYS[1], '+inf', live)
    end
  end
end
if op == 'swap' and mark ~= '' then
  redis.call('SET', marker, mark, 'PX', h[12])
  redis.call('ZADD', KEYS[1], redis.call('PEXPIRETIME', marker), marker)
else  -- a swap without a mark (a band shard's), or an apply done: no apply is to follow
  redis.call('UNLINK', marker)
  redis.call('ZREM', KEYS[1], marker)
end
return {'ok', last}
