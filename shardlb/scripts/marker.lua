#!lua flags=allow-oom
-- Set an expiring marker, even on a primary out of memory: a deletion's (keys.deleted_key,
-- shardlb/store.py), which must be made there for the deletion to go on and free memory, and the
-- ack marker of a deletion's confirmation (fanout.confirmed with freeing). One small key that
-- expires: what it writes is bounded.
--
-- KEYS[1] the marker; ARGV[1] its value, ARGV[2] how long it lives (ms).
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
