-- Count results per player and minute on ONE shard, for a board's max_results_per_player_per_minute
-- (shardlb/moderation.py). All KEYS share the shard's hash tag.
--
-- KEYS[1] the shard's key index, KEYS[2] this minute's counted (match, player) pairs (a set),
-- KEYS[3] this minute's counts per player (a hash), KEYS[4] the previous minute's pairs,
-- KEYS[5] the shard's `gone` marker, KEYS[6] the next minute's pairs (read only: a router whose
-- clock is ahead may have counted the pair there already, see below)
-- ARGV[1] the limit, ARGV[2] when this minute's keys expire (ms), ARGV[3] and ARGV[4] the first and
--         the current dedup bucket of an incr board (write.lua's `dd:<k>` sets; first > current on
--         other boards), ARGV[5] the shard, when the board's record says its shards carry sentinels
--         (write.lua's header item: its `here` must exist), else -1 (not looked at), then per
--         result: member (match_id NUL player_id), player
-- Returns per result 1 (allowed) or 0 (past the limit: not counted). A pair counted already, this
-- minute or the one before, is allowed and not counted again: a retry of a match is one result.
-- Routers' clocks differ: a router ahead counts a pair in a minute a router behind has not begun,
-- so the next minute's pairs count as seen too (until 2026-12-05 a retry through the router behind
-- was counted again, and at the limit refused though the board held it). Skews under a minute.
-- So is a pair in the dedup window (the bucket after the current one too, as write.lua looks
-- there): write.lua answers it `duplicate`, writing nothing, and a retry of a result applied
-- minutes ago must get that answer, not `rate_limit` (with a refused_results row for a result the
-- board holds). The dedup sets are only read here, never written: they are write.lua's.
--
-- A shard deleted (`gone`), resharded away (`mv` other than 't') or lost (its sentinel `here`
-- missing, on a board whose shards carry one) is refused as write.lua refuses it, nothing written:
-- its key index was dropped with its keys, and a counter listed here would make it again, without
-- expiry, where nothing deletes it (a router holds a board for seconds; after a loss of Redis, until
-- it sees the registry's version move). On a shard lost it would also be taken for one that holds
-- something (sentinel.lua's rule), and a fresh board's shard whose sentinel a failover lost would be
-- marked for a rebuild rather than given its sentinel again (until 2026-12-07). The sentinel rides in
-- the MGET of the other two markers: no command more.
local base = string.sub(KEYS[5], 1, -5)
local shard = tonumber(ARGV[5])
local marks = {base .. 'mv', KEYS[5]}
if shard >= 0 then marks[3] = base .. 'here' end
local marked = redis.call('MGET', unpack(marks))
if marked[1] and marked[1] ~= 't' then
  return redis.error_reply('BOARDMOVED this board is being resharded; retry')
end
if marked[2] then
  return redis.error_reply('BOARDGONE this board was deleted')
end
if shard >= 0 and not marked[3] then
  return redis.error_reply('SHARDLOST ' .. string.format('%d', shard) .. ' this shard lost its keys: rebuild it')
end
local limit, expire_at = tonumber(ARGV[1]), ARGV[2]
local first_bucket, now_bucket = tonumber(ARGV[3]), tonumber(ARGV[4])
local applied = {}  -- members in the dedup window: one SMISMEMBER per bucket for the whole call
if first_bucket <= now_bucket then
  local members = {}
  for i = 6, #ARGV, 2 do members[#members + 1] = ARGV[i] end
  for k = first_bucket, now_bucket + 1 do
    for first = 1, #members, 1000 do  -- unpack has a bound on its values
      local last = math.min(first + 999, #members)
      local got = redis.call('SMISMEMBER', base .. 'dd:' .. string.format('%d', k), unpack(members, first, last))
      for j = first, last do
        if got[j - first + 1] == 1 then applied[members[j]] = true end
      end
    end
  end
end
local out = {}
for i = 6, #ARGV, 2 do
  local member, player = ARGV[i], ARGV[i + 1]
  local ok = 1
  if not applied[member] and redis.call('SISMEMBER', KEYS[2], member) == 0
      and redis.call('SISMEMBER', KEYS[4], member) == 0
      and (not KEYS[6] or redis.call('SISMEMBER', KEYS[6], member) == 0) then
    if tonumber(redis.call('HGET', KEYS[3], player) or '0') >= limit then
      ok = 0
    else
      redis.call('SADD', KEYS[2], member)
      redis.call('HINCRBY', KEYS[3], player, 1)
    end
  end
  out[#out + 1] = ok
end
for k = 2, 3 do
  redis.call('PEXPIREAT', KEYS[k], expire_at)
  redis.call('ZADD', KEYS[1], expire_at, KEYS[k])
end
return out
