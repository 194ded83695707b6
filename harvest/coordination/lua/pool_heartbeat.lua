-- Extend one lease of a pool key, only for its own token and only while it is live.
--
-- KEYS[1]  the key's leases ZSET: token -> expiry (microseconds, Redis clock)
-- ARGV[1]  lease token
-- ARGV[2]  new ttl in microseconds (from now)
-- Returns  the new expiry in microseconds; 0 when the lease is lost (expired, reclaimed, or the
--          key left the pool). An expired lease found here is removed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if expiry and tonumber(expiry) > now then
  redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
  return now + tonumber(ARGV[2])
end
redis.call('ZREM', KEYS[1], ARGV[1])
return 0
