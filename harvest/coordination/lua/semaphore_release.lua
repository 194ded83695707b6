-- Give back a semaphore permit (or a place in line), only for its own token.
--
-- KEYS[1]  owners ZSET: token -> ticket
-- KEYS[2]  timeouts ZSET: token -> permit expiry (microseconds, Redis clock)
-- KEYS[3]  waiters ZSET: token -> ticket
-- KEYS[4]  waiter timeouts ZSET: token -> expiry of the place in line
-- ARGV[1]  token
-- Returns  1 when a live permit was released; 0 when the token held none (expired, released
--          before, or never granted). Any trace of the token is removed either way.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local expiry = redis.call('ZSCORE', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
if expiry and tonumber(expiry) > now then
  return 1
end
return 0
