-- Confirm band moves on a player's HOME shard once every band shard has taken them.
--
-- KEYS[1] the shard's version hash, KEYS[2] its pending-moves hash
-- ARGV: player, version, player, version... A player's pending entry is removed only when their
-- version is still the one the moves were sent for; a newer write keeps it (its moves are newer).
-- Returns how many pending entries were removed.
local done = 0
for i = 1, #ARGV, 2 do
  local player = ARGV[i]
  if redis.call('HGET', KEYS[1], player) == ARGV[i + 1] then
    done = done + redis.call('HDEL', KEYS[2], player)
  end
end
return done
