-- Move players between the band shards of a band board, ONE band shard per call.
--
-- KEYS[1] the band's total board, KEYS[2] its version hash, KEYS[3] the shard's key index,
-- KEYS[4] the shard's `gone` marker (the board was deleted: nothing is written)
-- ARGV: per player op ('a' add or update, 'r' remove), player, score, version
-- A player's version increases each time their total changes on their home shard. An op older than
-- what this band shard has seen for the player is dropped, so moves that arrive out of order (two
-- concurrent writes of one player) end in the state of the newest write, and an op sent again (a
-- retry, or a move the home shard still lists as pending) changes nothing. Returns ops applied.
--
-- A reshard's `mv` marker (named from the `gone` marker's prefix: the same hash tag) is read before
-- `gone`, as write.lua reads it: the old layout's keys are dropped after a reshard (leaving `gone`,
-- and `mv` 'm' for a day), and a late band call must hear "moved", not "deleted". 'm' (moved to the
-- new layout) and 'c' (a new layout not open yet) refuse the call. A seal does not: it holds back
-- the home shards' changes the mover copies, and a reshard never copies band shards (it builds the
-- new layout's from the home totals), so the old bands may as well stay current until the cut-over.
local base = string.sub(KEYS[4], 1, -5)
local marked = redis.call('MGET', base .. 'mv', KEYS[4])
if marked[1] and marked[1] ~= 't' then
  return redis.error_reply('BOARDMOVED this board is being resharded; retry')
end
if marked[2] then
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
