-- Forget the consumers of a journal's group that hold nothing and have been idle a long while: the
-- archivers that ran before (each process names its consumer after its host and pid, a k8s pod
-- after itself), whose entries XAUTOCLAIM has taken over. Redis keeps a consumer until it is
-- deleted, so every restart of every archiver left one more in every journal's group for good.
--
-- KEYS[1] the shard's journal (a stream)
-- ARGV[1] the consumer group, ARGV[2] the idle time (ms) from which a consumer without pending
--         entries is deleted, ARGV[3] the caller's own consumer (kept)
-- Returns how many consumers were deleted. One atomic call: a consumer found without pending
-- entries has none when it is deleted (XGROUP DELCONSUMER drops a consumer's pending entries). A
-- live archiver idle that long is made again by its next XREADGROUP, having lost nothing.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local ok, consumers = pcall(redis.call, 'XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if not ok then return 0 end  -- NOGROUP: no archiver has read this journal yet
local idle_ms, done = tonumber(ARGV[2]), 0
for _, c in ipairs(consumers) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['name'] ~= ARGV[3] and tonumber(f['pending']) == 0 and tonumber(f['idle']) >= idle_ms then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    done = done + 1
  end
end
return done
