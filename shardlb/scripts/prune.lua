-- Forget the versions of players removed long ago, on ONE shard of a band board (shardlb/bands.py,
-- BandMoves.prune): on every band shard first, then on the players' home shard.
--
-- KEYS[1] the shard's total board, KEYS[2] its version hash, KEYS[3] its key index, KEYS[4] its
--         `gone` marker; on the home shard also KEYS[5] its pending band moves, KEYS[6] its removed
--         players (`vrm`: player -> removal time, ms), KEYS[7] its version floor (`vfl`)
-- ARGV[1] home shard: the removal time (ms) at or before which a player may be forgotten
-- ARGV[2..] player, version (the removal's version, as read on the home shard; 0: forget nothing)
-- Returns how many versions this shard forgot.
--
-- A band shard forgets a player's version only while it is at most that version (a newer move was
-- taken: kept) and the player has no row there: it is the tombstone of the removal, which only a
-- move older than the removal could still need, and the caller waits the dedup window (an hour at
-- least) for those. The home shard forgets it only while it is still the removal's version, with
-- no pending move, no total and the removal at or before ARGV[1]: once every band shard answered,
-- none holds a version of the player above it (the removal's drop was confirmed, and a later move
-- would have changed the version here). The floor then rises to it: a player without a version
-- starts above the floor (write.lua, remove.lua), above anything a band may still hold of them (a
-- rebuild of the bands racing this call, a late drop). The player leaves `vrm`; so does one who
-- posted again since (they have a total: their versions are live), or whose version is gone.
--
-- The reshard's `mv` marker and `gone` are read as band.lua reads them.
local base = string.sub(KEYS[4], 1, -5)
local marked = redis.call('MGET', base .. 'mv', KEYS[4])
if marked[1] and marked[1] ~= 't' then
  return redis.error_reply('BOARDMOVED this board is being resharded; retry')
end
if marked[2] then
  return redis.error_reply('BOARDGONE this board was deleted')
end
local home = #KEYS >= 7
local cutoff = tonumber(ARGV[1])
local done, floor = 0, 0
for i = 2, #ARGV, 2 do
  local player, version = ARGV[i], tonumber(ARGV[i + 1])
  local held = redis.call('HGET', KEYS[2], player)
  local row = redis.call('ZSCORE', KEYS[1], player)
  if not home then
    if held and not row and tonumber(held) <= version then
      redis.call('HDEL', KEYS[2], player)
      done = done + 1
    end
  elseif row then
    redis.call('ZREM', KEYS[6], player)
  elseif redis.call('HEXISTS', KEYS[5], player) == 0 then
    local at = redis.call('ZSCORE', KEYS[6], player)
    if not held then
      redis.call('ZREM', KEYS[6], player)
    elseif version > 0 and tonumber(held) == version and at and tonumber(at) <= cutoff then
      redis.call('HDEL', KEYS[2], player)
      redis.call('ZREM', KEYS[6], player)
      if version > floor then floor = version end
      done = done + 1
    end
  end
end
if home then
  if floor > (tonumber(redis.call('GET', KEYS[7])) or 0) then
    redis.call('SET', KEYS[7], string.format('%d', floor))
    redis.call('ZADD', KEYS[3], '+inf', KEYS[7])
  end
  if redis.call('EXISTS', KEYS[6]) == 0 then redis.call('ZREM', KEYS[3], KEYS[6]) end
end
return done
