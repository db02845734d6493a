#!lua flags=no-writes
-- KEYS[1]: a shard's period key; ARGV[1]: a member; ARGV[2]: a radius r.
-- The member's score, its index in ZREVRANGE order (the rows ahead of it there), the key's size and
-- the rows from r above it to r below it, WITHSCORES: a player's home shard in one call, for
-- "around me" (shardlb/reads.py, View.near). false when the member has no row.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then return false end
local at = redis.call('ZREVRANK', KEYS[1], ARGV[1])
local r = tonumber(ARGV[2])
local first = at - r
if first < 0 then first = 0 end
return {score, at, redis.call('ZCARD', KEYS[1]), redis.call('ZREVRANGE', KEYS[1], first, at + r, 'WITHSCORES')}
