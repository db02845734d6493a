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
local key = KEYS[1]
local rows = cmsgpack.unpack(ARGV[1])
local out = {}
for i = 1, #rows, 2 do
  local score, me = rows[i], rows[i + 1]
  local lo = redis.call('ZCOUNT', key, '(' .. score, '+inf')
  local a, b = lo, lo + redis.call('ZCOUNT', key, score, score)
  while a < b do
    local mid = math.floor((a + b) / 2)
    local m = redis.call('ZREVRANGE', key, mid, mid)[1]
    if after(m, me) then a = mid + 1 else b = mid end
  end
  out[#out + 1] = a
end
return out
