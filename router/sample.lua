-- An equi-depth sample of ONE sorted set, best first: the members at ranks 0, s, 2s, ... and the last.
--
-- KEYS[1] a board's sorted set; ARGV[1] the number of steps K (about K + 1 samples).
-- Returns {size, member, score, rank, member, score, rank, ...} with ranks 0-based in ZREVRANGE
-- order. A set of at most K + 1 members is returned whole, so small shards are estimated exactly.
-- One call costs K + 1 O(log N) lookups on the shard instead of K + 1 round trips.
local key = KEYS[1]
local k = tonumber(ARGV[1])
local n = redis.call('ZCARD', key)
local out = {n}
if n == 0 then return out end
if n <= k + 1 then
  local all = redis.call('ZREVRANGE', key, 0, -1, 'WITHSCORES')
  for i = 1, #all, 2 do
    out[#out + 1] = all[i]
    out[#out + 1] = all[i + 1]
    out[#out + 1] = (i - 1) / 2
  end
  return out
end
local last = -1
for i = 0, k do
  local rank = math.floor(i * (n - 1) / k)
  if rank ~= last then
    local row = redis.call('ZREVRANGE', key, rank, rank, 'WITHSCORES')
    if row[1] then
      out[#out + 1] = row[1]
      out[#out + 1] = row[2]
      out[#out + 1] = rank
    end
    last = rank
  end
end
return out
