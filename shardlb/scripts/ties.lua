-- How many members of KEYS[1] with score exactly ARGV[1] order ahead of member ARGV[2].
-- In descending order equal scores are sorted by member, bytes compared, larger first; the tie
-- block is found with ZCOUNT and bisected with ZREVRANGE by index, O(log(ties) * log(N)).
-- Bytes are compared by hand: Lua's '<' on strings follows the server's locale (strcoll).
local function after(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = a:byte(i), b:byte(i)
    if x ~= y then return x > y end
  end
  return #a > #b
end
local key, score, me = KEYS[1], ARGV[1], ARGV[2]
local lo = redis.call('ZCOUNT', key, '(' .. score, '+inf')
local ties = redis.call('ZCOUNT', key, score, score)
local a, b = lo, lo + ties
while a < b do
  local mid = math.floor((a + b) / 2)
  local m = redis.call('ZREVRANGE', key, mid, mid)[1]
  if after(m, me) then a = mid + 1 else b = mid end
end
return a - lo
