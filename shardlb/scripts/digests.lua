-- Make the digests of the registry's records whole again (``BoardStore.digests``): a digest of
-- every record as registry.lua writes them (the first 16 hex digits of its SHA-1), none for a board
-- without a record, and the version now under the field '', through which they are whole.
--
-- KEYS[1] the registry, KEYS[2] the digests (a hash, registry.lua's KEYS[5]), KEYS[3] the
-- registry's version, all three in the registry's slot.
-- A router that cannot tell from the change log which records changed reads the digests of the
-- copies it keeps, with the version, and reads only the records whose digest differs from its copy's.
-- When the field '' is not the version, a process that writes no digest (of a release before them)
-- changed records since, or none was written yet (an upgrade, a registry lost with Redis): the
-- router calls this, which makes them whole once for every router that reads them at this version,
-- instead of each worker reading every record. (A process of a release before the version changes
-- records without moving it: its change is seen when the copies expire, as before.)
-- Returns 1.

local version = redis.call('GET', KEYS[3]) or ''
if redis.call('HGET', KEYS[2], '') == version then
  return 1
end
local records = redis.call('HGETALL', KEYS[1])
local digests = redis.call('HGETALL', KEYS[2])
local held = {}
for i = 1, #digests, 2 do
  held[digests[i]] = digests[i + 1]
end
held[''] = nil
for i = 1, #records, 2 do
  local digest = string.sub(redis.sha1hex(records[i + 1]), 1, 16)
  if held[records[i]] ~= digest then
    redis.call('HSET', KEYS[2], records[i], digest)
  end
  held[records[i]] = nil
end
for id in pairs(held) do
  redis.call('HDEL', KEYS[2], id)
end
redis.call('HSET', KEYS[2], '', version)
return 1
