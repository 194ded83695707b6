-- Extend a held permit of a semaphore, only for its own token and only while it is live.
--
-- KEYS[1]  owners ZSET: token -> ticket
-- KEYS[2]  timeouts ZSET: token -> permit expiry (microseconds, Redis clock)
-- ARGV[1]  token
-- ARGV[2]  new ttl in microseconds (from now)
-- Returns  the new expiry in microseconds, or 0 when the permit is not held (expired or
--          released; an expired permit is removed here).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local expiry = redis.call('ZSCORE', KEYS[2], ARGV[1])
if expiry and tonumber(expiry) > now then
  redis.call('ZADD', KEYS[2], 'XX', now + tonumber(ARGV[2]), ARGV[1])
  return now + tonumber(ARGV[2])
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
return 0
