-- An archiver's read of one journal for its round (shardlb/archive.py, ``Archiver._poll``): the
-- entries other consumers left pending past the claim time (XAUTOCLAIM), then its own (XREADGROUP).
-- One call instead of the three it took from Python (XAUTOCLAIM, XREADGROUP, and the COMMAND GETKEYS
-- redis-py's cluster client asks the server for before each XREADGROUP, its key being found by a
-- keyword), so a round's calls go as one pipeline per node (docs/design-notes.md, "Work that grows
-- with the whole cluster").
--
-- KEYS[1] the shard's journal (a stream)
-- ARGV[1] the consumer group, ARGV[2] the caller's consumer, ARGV[3] the claim time (ms),
--         ARGV[4] the entries read at most (each way), ARGV[5] XREADGROUP's id: '>' (new entries) or
--         '0' (the caller's own pending entries: after a failed round, or on a held journal)
-- Returns false when the journal does not exist: never made here (no MKSTREAM), a stream made for a
-- board deleted since would stay for good, its key in no index; a journal not written yet has
-- nothing to read. Else {claimed, read}: two lists of entries, each {id, {field, value, ...}}. The
-- group is made on the journal's first read (from its start, '0'), and again if it went.
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0')  -- BUSYGROUP: there already
local claimed = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], '0-0', 'COUNT', ARGV[4])
local read = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[4], 'STREAMS', KEYS[1], ARGV[5])
return {claimed[2], read and read[1][2] or {}}
