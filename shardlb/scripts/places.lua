#!lua flags=no-writes
-- ARGV[1]: a MessagePack array of player ids that live in KEYS[1] (their home key; one argument
-- for the client to encode, not one per id). For each, in this one atomic call: its
-- score there and how many rows rank ahead of it (ZREVRANK: a higher score, or the same score and
-- a larger id), or false, false where it has no row. "My friends" on a hash board starts here: the
-- rows ahead of a player in their own key come with their score, so the other keys only count.
local key = KEYS[1]
local members = cmsgpack.unpack(ARGV[1])
local scores = redis.call('ZMSCORE', key, unpack(members))
local out = {}
for i, member in ipairs(members) do
  local score = scores[i]
  out[2 * i - 1] = score
  out[2 * i] = score and redis.call('ZREVRANK', key, member)
end
return out
