-- Count the live permits of a semaphore (read only).
--
-- KEYS[1]  timeouts ZSET: token -> permit expiry (microseconds, Redis clock)
-- ARGV     none
-- Returns  the number of permits whose expiry is still in the future.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
return redis.call('ZCOUNT', KEYS[1], string.format('(%.0f', now), '+inf')
