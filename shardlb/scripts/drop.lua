#!lua flags=allow-oom
-- Delete ONE shard of a board: mark it gone, then unlink every key its key index lists.
--
-- KEYS[1] the shard's key index, KEYS[2] its `gone` marker; ARGV[1] how long the marker lives (ms).
-- Every key of the shard shares the tag of KEYS[1], so the listed keys are in this slot. Marking
-- and unlinking in one call means a write either ran before (and is unlinked here) or runs after
-- (and is refused by the marker): a router that still holds the board cannot leave keys behind.
-- allow-oom: a primary out of memory runs it (operators delete boards to free memory); it writes
-- one marker that expires, and unlinks the rest.
redis.call('SET', KEYS[2], '1', 'PX', ARGV[1])
local names = redis.call('ZRANGE', KEYS[1], 0, -1)
for _, name in ipairs(names) do
  redis.call('UNLINK', name)
end
redis.call('UNLINK', KEYS[1])
-- A reshard's keys (shardlb/reshard.py) and the shard's sentinel (keys.sentinel_key) are not in the index. A 'm' marker stays, with its TTL, so
-- a late write hears "moved" rather than "deleted".
local base = string.sub(KEYS[2], 1, -5)
redis.call('UNLINK', base .. 'chg', base .. 'chgw', base .. 'seal', base .. 'here')  -- 'here': its sentinel
if redis.call('GET', base .. 'mv') ~= 'm' then redis.call('UNLINK', base .. 'mv') end
return #names
