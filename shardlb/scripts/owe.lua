#!lua flags=allow-oom
-- Note that a board's DELETE owes PostgreSQL the record of its deletion (shardlb/archive.py,
-- owe_deletion), even on a registry primary out of memory: a DELETE frees memory, and must go on
-- there. Bounded: one incarnation id added to the board's set, which expires.
--
-- KEYS[1] the board's set of deletions owed; ARGV[1] the incarnation, ARGV[2] how long the set lives
-- (ms).
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
