-- Read a key pool's live state in one consistent view (read only: counts live leases and rate
-- grants by time instead of purging). Per-key names as in keys.py.
--
-- KEYS[1]  epoch STRING (absent: pool not loaded)
-- KEYS[2]  members ZSET: key_id -> key_id
-- ARGV[1]  pool prefix (keys.pool_prefix)
-- Returns  {-1} when the pool is not loaded; otherwise {epoch, now_us, then 8 values per key:
--          key_id, effective status (active|cooling|disabled), live leases, max_concurrency,
--          cooldown end in us (0 = none running), rate_n, rate period in us, rate grants in window}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local epoch = redis.call('GET', KEYS[1])
if not epoch then
  return {-1}
end
local prefix = ARGV[1]
local out = {tonumber(epoch), now}
for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local c = redis.call('HMGET', prefix .. 'key:' .. id,
    'max', 'rate_n', 'rate_us', 'status', 'cool_until')
  local cool = tonumber(c[5]) or 0
  if cool <= now then
    cool = 0
  end
  local status = c[4] or 'disabled'
  if status ~= 'disabled' then
    status = cool > 0 and 'cooling' or 'active'
  end
  local live = redis.call('ZCOUNT', prefix .. 'leases:' .. id, string.format('(%.0f', now), '+inf')
  local rate_n = tonumber(c[2]) or 0
  local rate_us = tonumber(c[3]) or 0
  local used = 0
  if rate_n > 0 then
    used = redis.call('ZCOUNT', prefix .. 'rate:' .. id,
      string.format('(%.0f', now - rate_us), '+inf')
  end
  for _, v in ipairs({tonumber(id), status, live, tonumber(c[1]) or 0, cool, rate_n, rate_us, used}) do
    table.insert(out, v)
  end
end
return out
