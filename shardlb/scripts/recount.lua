-- Count again the results a shard's journal holds not yet archived, and set its `logn` to that.
-- All KEYS share the shard's hash tag.
--
-- KEYS[1]  the shard's journal (a stream), KEYS[2] its `logn` (write.lua: results not archived yet)
-- ARGV[1]  the consumer group, ARGV[2] limit: the most entries to read
-- Returns the count set, or -1 when nothing was set: no count kept, no journal, or more than
-- `limit` entries not acknowledged (the caller tries again later).
--
-- Not acknowledged = delivered and pending, or never delivered (after the group's last-delivered
-- id; every entry when no archiver made the group yet): exactly what write.lua counts up and
-- ack.lua counts down, each entry by its n (0 without one). Acknowledged entries the archiver has
-- not trimmed yet are not counted. One atomic call, so no write or ack falls between the reading
-- and the setting. The archiver runs it now and then (shardlb/archive.py): a count that drifted
-- (an archiver of before, which acknowledged without counting down) is set right while the shard
-- is busy, not only when its journal is next empty.
if redis.call('EXISTS', KEYS[2]) == 0 or redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local limit = tonumber(ARGV[2])
local last, pending = nil, 0
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local f = {}
  for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
  if f['name'] == ARGV[1] then last, pending = f['last-delivered-id'], tonumber(f['pending']) end
end
if pending > limit then return -1 end
local function count_of(entry)
  local fields = entry[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'n' then return tonumber(fields[i + 1]) end
  end
  return 0
end
local fresh = redis.call('XRANGE', KEYS[1], last and ('(' .. last) or '-', '+', 'COUNT', limit + 1)
if #fresh + pending > limit then return -1 end
local sum = 0
for _, entry in ipairs(fresh) do sum = sum + count_of(entry) end
if pending > 0 then
  for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', limit)) do
    local entry = redis.call('XRANGE', KEYS[1], p[1], p[1])[1]
    if entry then sum = sum + count_of(entry) end
  end
end
redis.call('SET', KEYS[2], string.format('%d', sum))
return sum
