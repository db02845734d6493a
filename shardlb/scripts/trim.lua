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

local function deleted()
  return fields(redis.call('XINFO', 'STREAM', KEYS[1]))['max-deleted-entry-id'] or '0-0'
end

local last = nil
for _, g in ipairs(groups) do
  local f = fields(g)
  if f['name'] == ARGV[1] then last = f['last-delivered-id'] end
end
if last == nil then return false end
-- The entries to go: those up to the last one handed out, or before the oldest pending one if that
-- is older. Every pending entry was handed out, so it is at or before the last one (unless XGROUP
-- SETID moved the group back): the oldest pending entry up to the last one handed out is the floor,
-- and with none the last one handed out is the newest to go. Redis compares the ids, never Lua,
-- whose numbers are doubles: the floor computed here (the id after the last handed out, until
-- 2026-12-06) was rounded past 2^53, up as well as down, and an entry not handed out yet went too.
-- write.lua's ids never come near (ms, and a small sequence), but any explicit id may.
local oldest = redis.call('XPENDING', KEYS[1], ARGV[1], '-', last, 1)
local below
if #oldest > 0 then
  below = redis.call('XREVRANGE', KEYS[1], '(' .. oldest[1][1], '-', 'COUNT', 1)
else
  below = redis.call('XREVRANGE', KEYS[1], last, '-', 'COUNT', 1)
end
if #below == 0 then return deleted() end
local newest = below[1][1]
redis.call('XTRIM', KEYS[1], 'MINID', newest)
redis.call('XDEL', KEYS[1], newest)
return deleted()
