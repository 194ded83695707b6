-- One execution process says it is alive: replace its info hash and push its expiry, judged by
-- the Redis clock, and purge processes whose expiry passed.
--
-- KEYS[1]  index ZSET: worker id -> expiry (Redis time, milliseconds)
-- KEYS[2]  this worker's info HASH
-- ARGV[1]  worker id
-- ARGV[2]  ttl in milliseconds
-- ARGV[3..] field, value, field, value, ...
-- Returns  the Redis time in milliseconds
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('DEL', KEYS[2])
if #ARGV > 2 then
  redis.call('HSET', KEYS[2], unpack(ARGV, 3))
end
redis.call('HSET', KEYS[2], 'last_seen_ms', now)
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
return now
