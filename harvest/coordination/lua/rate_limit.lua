-- Sliding-window log rate limiter: admit one call when fewer than `limit` calls were admitted
-- in the last `period` (half-open window (now - period, now], Redis clock). Never more than
-- `limit` admissions fall in any window of length `period`.
--
-- KEYS[1]  window ZSET: member = unique call id, score = admission time (microseconds)
-- ARGV[1]  limit: calls admitted per period (>= 1)
-- ARGV[2]  period in microseconds
-- ARGV[3]  unique call id (becomes the member)
-- Returns  {1, 0} when admitted;
--          {0, retry_after_us} when refused: microseconds until the window has room again.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local limit = tonumber(ARGV[1])
local period = tonumber(ARGV[2])

redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - period)
local used = redis.call('ZCARD', KEYS[1])
if used >= limit then
  local leaving = redis.call('ZRANGE', KEYS[1], used - limit, used - limit, 'WITHSCORES')
  return {0, tonumber(leaving[2]) + period - now}
end
redis.call('ZADD', KEYS[1], now, ARGV[3])
redis.call('PEXPIRE', KEYS[1], math.ceil(period / 1000) + 1000)
return {1, 0}
