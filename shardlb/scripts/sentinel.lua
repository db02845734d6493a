-- Write a shard's sentinel (keys.sentinel_key) again when it went missing from a shard that holds
-- nothing and of which PostgreSQL holds nothing either (a band shard: whose home shards hold no total,
-- version or pending move, what its rebuild reads; shardlb/archive.py, ``Archiver._empty``):
-- a failover lost the sentinel of a board just created (or just rebuilt) before its replica had it,
-- and a rebuild would bring nothing back. Set only if the shard still holds none of the keys below:
-- every write and removal to a board's shard writes its journal and key index (write.lua,
-- remove.lua: both refuse, writing nothing, while the sentinel is missing), a rebuild its period
-- keys and key index, a reshard its marker, a deletion its `gone` marker (kept after the drop, with
-- its TTL: a sentinel written after the drop would outlive the board, for it never expires).
--
-- KEYS[1] the shard's sentinel; KEYS[2..] the shard's keys that say it holds something (or held:
--         `gone`, a reshard's `mv`), all in the sentinel's slot
-- Returns 1 when it set the sentinel, 0 when the sentinel is there already (written meanwhile: a
-- rebuild, another archiver), -1 when the shard holds something (the caller marks it as lost).
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then return -1 end
end
redis.call('SET', KEYS[1], '1')
return 1
