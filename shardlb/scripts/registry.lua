-- Compare-and-set one board's record in the registry hash.
--
-- KEYS[1] the registry; ARGV[1] board id, ARGV[2] the record expected now, ARGV[3] the new record
-- ('' removes the field). Returns 1 when the record was as expected and has been replaced, else 0.
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then
  return 0
end
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
end
return 1
