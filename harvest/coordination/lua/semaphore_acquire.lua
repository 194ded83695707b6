-- Fair counting semaphore with expiring permits ("Redis in Action" 6.3, in one script).
-- Expired permits and waiters are purged first. Every attempt takes a ticket from the counter;
-- a caller that waits keeps its ticket in the waiters ZSET, and a permit goes to a caller only
-- when fewer live waiters hold an older ticket than there are free permits (first come, first
-- served: a newcomer never overtakes someone already waiting).
--
-- KEYS[1]  owners ZSET: token -> ticket of each held permit
-- KEYS[2]  timeouts ZSET: token -> permit expiry (microseconds, Redis clock)
-- KEYS[3]  counter STRING: ticket source (INCR)
-- KEYS[4]  waiters ZSET: token -> ticket of each caller waiting in line
-- KEYS[5]  waiter timeouts ZSET: token -> expiry of that place in line
-- ARGV[1]  limit (permits, >= 1)
-- ARGV[2]  token of the caller
-- ARGV[3]  permit ttl in microseconds
-- ARGV[4]  0: try once and do not queue; > 0: keep (or take) a place in line for this many us
-- Returns  {1, ticket, expires_at_us} when the permit is granted (or was already held: renewed);
--          {0, retry_after_us} when refused (0 when a free permit is promised to an earlier waiter).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local limit = tonumber(ARGV[1])
local token = ARGV[2]
local ttl = tonumber(ARGV[3])
local wait = tonumber(ARGV[4])

local function purge(index, other)
  local gone = redis.call('ZRANGEBYSCORE', index, '-inf', now)
  for _, member in ipairs(gone) do
    redis.call('ZREM', index, member)
    redis.call('ZREM', other, member)
  end
end
purge(KEYS[2], KEYS[1])
purge(KEYS[5], KEYS[4])

local held = redis.call('ZSCORE', KEYS[1], token)
if held then
  redis.call('ZADD', KEYS[2], now + ttl, token)
  return {1, tonumber(held), now + ttl}
end

local free = limit - redis.call('ZCARD', KEYS[1])
local ticket = redis.call('ZSCORE', KEYS[4], token)
local ahead
if ticket then
  ticket = tonumber(ticket)
  ahead = redis.call('ZCOUNT', KEYS[4], '-inf', string.format('(%.0f', ticket))
else
  ticket = redis.call('INCR', KEYS[3])
  ahead = redis.call('ZCARD', KEYS[4])
end

if ahead < free then
  redis.call('ZREM', KEYS[4], token)
  redis.call('ZREM', KEYS[5], token)
  redis.call('ZADD', KEYS[1], ticket, token)
  redis.call('ZADD', KEYS[2], now + ttl, token)
  return {1, ticket, now + ttl}
end

if wait > 0 then
  redis.call('ZADD', KEYS[4], ticket, token)
  redis.call('ZADD', KEYS[5], now + wait, token)
end
if free > 0 then
  return {0, 0}
end
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
return {0, tonumber(first[2]) - now}
