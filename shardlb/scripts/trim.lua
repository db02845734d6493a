-- Drop a journal's entries that every consumer has acknowledged (shardlb/archive.py, ``trim``): those
-- older than its oldest pending entry or, with none pending, up to what the group has been given.
-- One call (until 2026-12-06 five from Python: XINFO GROUPS, XPENDING, XREVRANGE, XTRIM, XDEL, and
-- an XINFO STREAM for the archiver's gap check), so an archiver's idle trims go as one pipeline per
-- node.
--
-- KEYS[1] the shard's journal (a stream)
-- ARGV[1] the consumer group
-- Returns the stream's max-deleted-entry-id after the trim ('0-0': none deleted yet), which the
-- archiver compares with the newest entry PostgreSQL holds (``_GAPS``); false when the journal or
-- its group does not exist.
--
-- The newest entry to go is deleted on its own (XDEL), after the trim of those before it: XTRIM
-- leaves max-deleted-entry-id as it was, XDEL sets it. The whole call is atomic, so no entry is
-- handed out between the reading of the group and of its pending entries.
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if not ok then return false end

local function fields(flat)
  local f = {}
  for i = 1, #flat, 2 do f[flat[i]] = flat[i + 1] end
  return f
end

local function order(id)  -- an entry id as two numbers, compared as Redis orders them
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end

local function before(a, b)
  local am, as = order(a)
  local bm, bs = order(b)
  return am < bm or (am == bm and as < bs)
end

local function deleted()
  return fields(redis.call('XINFO', 'STREAM', KEYS[1]))['max-deleted-entry-id'] or '0-0'
end

local last = nil
for _, g in ipairs(groups) do
  local f = fields(g)
  if f['name'] == ARGV[1] then last = f['last-delivered-id'] end
end
if last == nil then return false end
-- The floor: the entry after the last one handed out, or the oldest pending one if older.
local ms, seq = order(last)
local floor = string.format('%d-%d', ms, seq + 1)
local pending = redis.call('XPENDING', KEYS[1], ARGV[1])
if tonumber(pending[1]) > 0 and before(pending[2], floor) then floor = pending[2] end
local below = redis.call('XREVRANGE', KEYS[1], '(' .. floor, '-', 'COUNT', 1)
if #below == 0 then return deleted() end
local newest = below[1][1]
redis.call('XTRIM', KEYS[1], 'MINID', newest)
redis.call('XDEL', KEYS[1], newest)
return deleted()
