-- Compare-and-set one board's record in the registry hash, keep its place in the index of the
-- records that name a reshard under way (shardlb/store.py, ``resharding``), and move the
-- registry's version (``BoardStore.follow``) and note the move in the registry's change log
-- (``BoardStore.moved``: routers learn which record changed), and write the record's digest
-- (``BoardStore.digests``), all in one call.
--
-- KEYS[1] the registry, KEYS[2] the index (a set of board ids), KEYS[3] the registry's version (a
-- string), KEYS[4] the change log (a list, newest first), KEYS[5] the digests (a hash: board id ->
-- the first 16 hex digits of the record's SHA-1, and '' -> the version through which every digest
-- is its record's), all five in the registry's slot.
-- ARGV[1] board id, ARGV[2] the record expected now ('' : none, a creation), ARGV[3] the new
-- record ('' removes the field), ARGV[4] the registry's new version (drawn by the caller),
-- ARGV[5] how many entries the log keeps.
-- Each entry is '<version before> <version after> <board id>' ('' before: no version yet), so a
-- reader can tell a chain of moves the log holds whole from one that a writer without the log (a
-- process of the release before) or a failover broke.
-- Returns 1 when the record was as expected and has been replaced, else 0.
-- ARGV[1] '': index the boards ARGV[2..] as their records are now, and return 1 (a whole look's
-- mending of what processes of the release before wrote without the index; no record changes, the
-- version stays).
-- ARGV[6] 'freeing': the call of a deletion (``BoardStore.swap``'s ``freeing``), made through this
-- script loaded with the flag allow-oom, which a primary out of memory runs (operators delete
-- boards to free memory). Only a removal of the record or its mark "deleting" is taken then, so
-- what it writes is bounded: a record at most 32 bytes longer than the one it replaces (or none), the
-- version and a digest of fixed size, one entry in a log kept at ARGV[5] entries, an id the index
-- holds already. Anything else is an error, and nothing is written.

-- Listed while the record has a "reshard" object; the registry's readers parse the same field.
local function index(id)
  local raw = redis.call('HGET', KEYS[1], id)
  local moving = false
  if raw then
    local parsed, record = pcall(cjson.decode, raw)
    moving = parsed and type(record) == 'table' and type(record['reshard']) == 'table'
  end
  if moving then
    redis.call('SADD', KEYS[2], id)
  else
    redis.call('SREM', KEYS[2], id)
  end
end

if ARGV[1] == '' then
  for i = 2, #ARGV do
    index(ARGV[i])
  end
  return 1
end
-- (After the mending, whose ARGV are board ids, 'freeing' among them perhaps.)
if ARGV[6] == 'freeing' and ARGV[3] ~= '' then
  local parsed, record = pcall(cjson.decode, ARGV[3])
  local marked = parsed and type(record) == 'table' and record['state'] == 'deleting'
  -- The mark replaces the record's state (or adds one, to a record of a release before): 32 bytes
  -- more at most.
  if not (marked and #ARGV[3] <= #ARGV[2] + 32) then
    return redis.error_reply('ERR registry: a freeing call only removes a record or marks it deleting')
  end
end
-- A record is JSON, never '': '' expects none.
if (redis.call('HGET', KEYS[1], ARGV[1]) or '') ~= ARGV[2] then
  return 0
end
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
end
index(ARGV[1])
local before = redis.call('GET', KEYS[3]) or ''
redis.call('SET', KEYS[3], ARGV[4])
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[5], ARGV[1])
else
  redis.call('HSET', KEYS[5], ARGV[1], string.sub(redis.sha1hex(ARGV[3]), 1, 16))
end
-- Every digest stays its record's through this move only if it was through the one before: a
-- process of a release before the digests moves the version without writing one (digests.lua then
-- makes them all again).
if redis.call('HGET', KEYS[5], '') == before then
  redis.call('HSET', KEYS[5], '', ARGV[4])
end
redis.call('LPUSH', KEYS[4], before .. ' ' .. ARGV[4] .. ' ' .. ARGV[1])
redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[5]) - 1)
return 1
