-- Move players between the band shards of a band board, ONE band shard per call.
--
-- KEYS[1] the band's total board, KEYS[2] its version hash, KEYS[3] the shard's key index,
-- KEYS[4] the shard's `gone` marker (the board was deleted: nothing is written)
-- ARGV: per player op ('a' add or update, 'r' remove), player, score, version
-- A player's version increases each time their total changes on their home shard. An op older than
-- what this band shard has seen for the player is dropped, so moves that arrive out of order (two
-- concurrent writes of one player) end in the state of the newest write, and an op sent again (a
-- retry, or a move the home shard still lists as pending) changes nothing. Returns ops applied.
if redis.call('EXISTS', KEYS[4]) == 1 then
  return redis.error_reply('BOARDGONE this board was deleted')
end
local applied = 0
for i = 1, #ARGV, 4 do
  local op, player, score, version = ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3])
  local seen = redis.call('HGET', KEYS[2], player)
  if not seen or tonumber(seen) < version then
    redis.call('HSET', KEYS[2], player, version)
    if op == 'a' then
      redis.call('ZADD', KEYS[1], score, player)
    else
      redis.call('ZREM', KEYS[1], player)
    end
    applied = applied + 1
  end
end
redis.call('ZADD', KEYS[3], '+inf', KEYS[1], '+inf', KEYS[2])
return applied
