-- Apply a batch of results to ONE shard atomically. All KEYS share the shard's hash tag.
--
-- KEYS[1]     the shard's key index (sorted set: key name -> expiry ms, +inf for none)
-- KEYS[2..]   period boards, dedup buckets and (band boards) the version hash
-- ARGV: mode, time_bits, points_max, order, tiebreak, now_ms, periods_per_result, version_key_index,
--       dedup_bucket_count, <dedup key indices: older buckets first, current bucket last>,
--       <expiry ms for each KEYS[i], i = 1..#KEYS, 0 = never>,
--       then ONE MessagePack array, flat: per result player, score, points, time_units, dedup_member,
--       <period key indices, total first>. (One packed argument instead of thousands: the client
--       spends most of its time encoding arguments one by one.)
-- Returns per result: status (i improved, u unchanged, d duplicate, o overflow), total score after,
--       version (band boards, 0 when the total did not change), total score before ('' when none).
-- Scores are integers below 2^53, which Lua doubles hold exactly; they are formatted with %.0f
-- because Lua's default number formatting keeps only 14 digits.

local mode = ARGV[1]
local T = 2 ^ tonumber(ARGV[2])
local pmax = tonumber(ARGV[3])
local desc = ARGV[4] == 'desc'
local earliest = ARGV[5] == 'earliest'
local now = tonumber(ARGV[6])
local P = tonumber(ARGV[7])
local vk = tonumber(ARGV[8])
local ndd = tonumber(ARGV[9])
local dd = {}
for i = 1, ndd do dd[i] = KEYS[tonumber(ARGV[9 + i])] end
local exp_base = 9 + ndd
local items = cmsgpack.unpack(ARGV[exp_base + #KEYS + 1])
local pos = 1
local tmax = T - 1

local function fmt(x) return string.format('%.0f', x) end
local function split(score)
  local pp = math.floor(score / T)
  local tp = score - pp * T
  local points = desc and pp or (pmax - pp)
  local units = earliest and (tmax - tp) or tp
  return points, units
end
local function join(points, units)
  local pp = desc and points or (pmax - points)
  local tp = earliest and (tmax - units) or units
  return pp * T + tp
end
local function zscore(key, member)
  local s = redis.call('ZSCORE', key, member)
  if s then return tonumber(s) end
  return nil
end

local touched = {}
local out = {}
while pos <= #items do
  local player, score = items[pos], items[pos + 1]
  local score_text = fmt(score)
  local points, units, member = items[pos + 2], items[pos + 3], items[pos + 4]
  local pk = {}
  for j = 1, P do pk[j] = items[pos + 4 + j] end
  pos = pos + 5 + P
  local total = KEYS[pk[1]]
  local before = zscore(total, player)
  local status = 'u'

  if mode == 'best' then
    if before == nil or score > before then status = 'i' end
    -- The total needs no ZADD when the score does not beat it (most results of a regular player);
    -- period boards may hold less than the total, so each gets its ZADD GT.
    for j = (status == 'i') and 1 or 2, P do
      redis.call('ZADD', KEYS[pk[j]], 'GT', score_text, player)
      touched[pk[j]] = true
    end
  elseif mode == 'set' then
    for j = 1, P do
      local key = KEYS[pk[j]]
      local old = (j == 1) and before or zscore(key, player)
      local replace = old == nil
      if not replace then
        local _, old_units = split(old)
        replace = units > old_units or (units == old_units and score > old)
      end
      if replace then
        redis.call('ZADD', key, score_text, player)
        touched[pk[j]] = true
        if j == 1 and score ~= old then status = 'i' end
      end
    end
  else
    local seen = false
    for i = 1, ndd do
      if redis.call('SISMEMBER', dd[i], member) == 1 then seen = true break end
    end
    if seen then
      status = 'd'
    else
      local new = {}
      for j = 1, P do
        local old = (j == 1) and before or zscore(KEYS[pk[j]], player)
        local op, ou = 0, units
        if old ~= nil then op, ou = split(old) end
        if op + points > pmax then status = 'o' break end
        new[j] = join(op + points, math.max(ou, units))
      end
      if status ~= 'o' then
        for j = 1, P do
          redis.call('ZADD', KEYS[pk[j]], fmt(new[j]), player)
          touched[pk[j]] = true
        end
        redis.call('SADD', dd[ndd], member)
        touched[tonumber(ARGV[9 + ndd])] = true
        if points > 0 or before == nil then status = 'i' end
      end
    end
  end

  local after
  if mode == 'best' then
    after = (before == nil or score > before) and score or before  -- what ZADD GT left
  else
    after = zscore(total, player)
  end
  local version = 0
  if vk > 0 and after ~= before then
    version = redis.call('HINCRBY', KEYS[vk], player, 1)
    touched[vk] = true
  end
  out[#out + 1] = status
  out[#out + 1] = after and fmt(after) or ''
  out[#out + 1] = version
  out[#out + 1] = before and fmt(before) or ''
end

for i, _ in pairs(touched) do
  local expire_at = tonumber(ARGV[exp_base + i])
  if expire_at > 0 then
    redis.call('PEXPIREAT', KEYS[i], expire_at)
    redis.call('ZADD', KEYS[1], expire_at, KEYS[i])
  else
    redis.call('ZADD', KEYS[1], '+inf', KEYS[i])
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. fmt(now))
return out
