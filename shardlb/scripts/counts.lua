#!lua flags=no-writes
-- ARGV[1]: a MessagePack array, flat: score (a decimal string), member, score, member...
-- For each (score, member) pair, how many members of KEYS[1] rank ahead of it: a higher
-- score, or the same score and a larger member (bytes compared) -- the order ZREVRANGE returns.
-- Equal scores are resolved by bisecting the tie block by index, O(log(ties) * log(N)). Bytes are
-- compared by hand: Lua's '<' on strings follows the server's locale (strcoll).
local function after(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = a:byte(i), b:byte(i)
    if x ~= y then return x > y end
  end
  return #a > #b
end
-- ARGV[2], optional: a MessagePack array of the pair numbers (1, 2...) whose member should live in
-- KEYS[1] with that score (its home shard, or its band on a band board): where one ZMSCORE finds it
-- there at that very score, ZREVRANK counts the rows ahead of it, ties included, in one call instead
-- of two counts and a bisection of the tie block it is part of. Where it is not there at that score
-- (it moved or changed since its score was read, or a band move is still pending), it is counted;
-- a row it has there at a better score (a band's stale row of a pending move) is its own and does
-- not count ahead of it.
-- ARGV[3], optional (ARGV[2] then given, an empty array if no pair is marked): the key's size
-- (ZCARD) follows the counts, taken in the same call, so that a rank's count of this key and its
-- share of the board's size are of one moment.
local key = KEYS[1]
local rows = cmsgpack.unpack(ARGV[1])
local home, own = {}, {}
if ARGV[2] then
  local marked = cmsgpack.unpack(ARGV[2])
  if #marked > 0 then
    local members = {}
    for j, n in ipairs(marked) do members[j] = rows[2 * n] end
    local held = redis.call('ZMSCORE', key, unpack(members))
    for j, n in ipairs(marked) do
      local at, score = held[j] and tonumber(held[j]), tonumber(rows[2 * n - 1])
      if at == score then home[n] = true elseif at and at > score then own[n] = true end
    end
  end
end
local out = {}
for i = 1, #rows, 2 do
  local score, me = rows[i], rows[i + 1]
  local a = home[(i + 1) / 2] and redis.call('ZREVRANK', key, me)
  if not a then -- not held here at that score: count it
    local lo = redis.call('ZCOUNT', key, '(' .. score, '+inf')
    local b = lo + redis.call('ZCOUNT', key, score, score)
    a = lo
    while a < b do
      local mid = math.floor((a + b) / 2)
      local m = redis.call('ZREVRANGE', key, mid, mid)[1]
      if after(m, me) then a = mid + 1 else b = mid end
    end
    if own[(i + 1) / 2] then a = a - 1 end
  end
  out[#out + 1] = a
end
if ARGV[3] then out[#out + 1] = redis.call('ZCARD', key) end
return out
