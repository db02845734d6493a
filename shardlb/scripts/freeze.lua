-- Freeze ONE period on ONE shard: from this call on, write.lua applies nothing more to it. The
-- total's marker closes the whole shard: write.lua refuses every result (a season's archive).
--
-- KEYS[1] the shard's key index, KEYS[2] its `gone` marker, KEYS[3] the period's frozen marker.
-- ARGV[1] when the period's keys expire (epoch ms; the marker expires with them; 0: never, the
-- total's), ARGV[2] now (ms).
-- The marker keeps the time of the first freeze, so a retried or repeated freeze changes nothing.
-- Returns 1 when this call froze the period, 0 when it was frozen already.
local base = string.sub(KEYS[2], 1, -5)  -- a reshard's marker, as in write.lua; while it only
local move = redis.call('GET', base .. 'mv')  -- tracks, the mover copies frozen markers when it seals
if move and (move ~= 't' or redis.call('EXISTS', base .. 'seal') == 1) then
  return redis.error_reply('BOARDMOVED this board is being resharded; retry')
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return redis.error_reply('BOARDGONE this board was deleted')
end
local fresh = redis.call('SET', KEYS[3], ARGV[2], 'NX') and 1 or 0
if ARGV[1] == '0' then
  redis.call('ZADD', KEYS[1], '+inf', KEYS[3])
else
  redis.call('PEXPIREAT', KEYS[3], ARGV[1])
  redis.call('ZADD', KEYS[1], ARGV[1], KEYS[3])
end
return fresh
