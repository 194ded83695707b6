-- Write a key pool's key set and per-key config, then bump the pool epoch.
-- Keys no longer listed lose their config, leases, rate and token windows. Keys kept keep their
-- live leases, rate and token windows. A sync never shortens a cooldown that is still running in Redis
-- (a 429 seen a moment ago outlives a periodic sync from a stale source).
-- Per-key names are <prefix>key:<id>, <prefix>leases:<id>, <prefix>rate:<id>,
-- <prefix>tokens:<id> (see keys.py).
--
-- KEYS[1]  epoch STRING (INCR; its absence means the pool is not loaded)
-- KEYS[2]  members ZSET: key_id -> key_id
-- ARGV[1]  pool prefix (keys.pool_prefix)
-- ARGV[2..] eight values per key: key_id, max_concurrency, rate_n (0 = no rate limit),
--          rate period in microseconds, status (active|cooling|disabled),
--          cooldown end in microseconds (0 = none), tpm (tokens per window, 0 = no budget),
--          token window in microseconds
-- Returns  the new epoch
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local prefix = ARGV[1]

local wanted = {}
for i = 2, #ARGV, 8 do
  wanted[ARGV[i]] = true
end
for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  if not wanted[id] then
    redis.call('DEL', prefix .. 'key:' .. id, prefix .. 'leases:' .. id, prefix .. 'rate:' .. id,
      prefix .. 'tokens:' .. id)
    redis.call('ZREM', KEYS[2], id)
  end
end

for i = 2, #ARGV, 8 do
  local id = ARGV[i]
  local config = prefix .. 'key:' .. id
  local cool = tonumber(ARGV[i + 5])
  local running = tonumber(redis.call('HGET', config, 'cool_until')) or 0
  if running > now and running > cool then
    cool = running
  end
  redis.call('HSET', config, 'max', ARGV[i + 1], 'rate_n', ARGV[i + 2], 'rate_us', ARGV[i + 3],
    'status', ARGV[i + 4], 'cool_until', cool, 'tpm', ARGV[i + 6], 'tpm_us', ARGV[i + 7])
  redis.call('ZADD', KEYS[2], tonumber(id), id)
end
return redis.call('INCR', KEYS[1])
