-- Free one lease of a pool key, only for its own token.
--
-- KEYS[1]  the key's leases ZSET: token -> expiry (microseconds, Redis clock)
-- ARGV[1]  lease token
-- Returns  1 when a live lease was freed; 0 when it was already lost (expired, reclaimed, or the
--          key left the pool). The token is removed either way.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
if expiry and tonumber(expiry) > now then
  return 1
end
return 0
