-- Acknowledge journal entries the archiver has committed to PostgreSQL, and take their results off
-- the shard's count of results not archived. All KEYS share the shard's hash tag.
--
-- KEYS[1]  the shard's journal (a stream), KEYS[2] its `logn` (write.lua: results not archived yet)
-- ARGV[1]  the consumer group; ARGV[2..] pairs: entry id, its count of results (the entry's n: a
--          delete entry's players; 0 for an entry without one, journaled before there was n)
-- Returns the results taken off.
--
-- An entry counts only when its XACK acknowledges it (XACK answers 1 once per delivered entry,
-- whichever consumer acks it, however often it is retried), so a retried or overlapping ack takes
-- each entry off once. The count is written only while it exists: a board deleted meanwhile
-- (drop.lua unlinks it) gets no stray key back.
local done = 0
for i = 2, #ARGV, 2 do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then done = done + tonumber(ARGV[i + 1]) end
end
if done > 0 and redis.call('EXISTS', KEYS[2]) == 1 then redis.call('DECRBY', KEYS[2], done) end
return done
