-- An archiver's read of one journal for its round (shardlb/archive.py, ``Archiver._poll``): the
-- entries other consumers left pending past the claim time (XAUTOCLAIM), then its own (XREADGROUP).
-- One call instead of the three it took from Python (XAUTOCLAIM, XREADGROUP, and the COMMAND GETKEYS
-- redis-py's cluster client asks the server for before each XREADGROUP, its key being found by a
-- keyword), so a round's calls go as one pipeline per node (docs/design-notes.md, "Work that grows
-- with the whole cluster").
--
-- KEYS[1] the shard's journal (a stream), KEYS[2] the shard's sentinel (keys.sentinel_key), or the
--         journal again when ARGV[6] is '0' (a key that does not exist would make Redis answer
--         TRYAGAIN while a move of the slot is open)
-- ARGV[1] the consumer group, ARGV[2] the caller's consumer, ARGV[3] the claim time (ms),
--         ARGV[4] the entries read at most (each way), ARGV[5] what XREADGROUP reads: '>' (new
--         entries), '0' (the caller's own pending entries: on a held journal) or '0>' (the caller's
--         own pending entries, and new ones if it holds none: after a failed round, or when the
--         caller may be an archiver started again under its name), ARGV[6] '1' when the board's
--         record says its shards carry sentinels (else '0': KEYS[2] is not looked at)
-- Returns false when the journal does not exist: never made here (no MKSTREAM), a stream made for a
-- board deleted since would stay for good, its key in no index; a journal not written yet has
-- nothing to read. Else {claimed, read, own}: two lists of entries, each {id, {field, value, ...}},
-- and 1 when `read` holds the caller's pending entries (0 when new ones). The group is made on the
-- journal's first read (from its start, '0'), and again if it went.
-- With ARGV[6] '1' and the sentinel missing (Redis lost the shard's slot: shardlb/archive.py marks
-- the shard), the reply has a 4th item, 1 ({false, false, false, 1} for a journal that does not
-- exist); the journal is read as ever.
local lost = ARGV[6] == '1' and redis.call('EXISTS', KEYS[2]) == 0
if redis.call('EXISTS', KEYS[1]) == 0 then
  if lost then return {false, false, false, 1} end
  return false
end
redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0')  -- BUSYGROUP: there already
local claimed = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], '0-0', 'COUNT', ARGV[4])
local function group_read(from)
  local read = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[4], 'STREAMS', KEYS[1], from)
  return read and read[1][2] or {}
end
local flag = lost and 1 or 0
if ARGV[5] == '>' then return {claimed[2], group_read('>'), 0, flag} end
local own = group_read('0')
if ARGV[5] == '0>' then
  local held = false  -- a pending entry deleted since comes back without its fields: none to read
  for _, entry in ipairs(own) do
    if entry[2] then held = true break end
  end
  if not held then return {claimed[2], group_read('>'), 0, flag} end
end
return {claimed[2], own, 1, flag}
