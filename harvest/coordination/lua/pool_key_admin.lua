-- Change the state of one pool key: cooldown (429 / Retry-After), disable or enable.
-- A cooldown never shortens a running one, and leaves a disabled key disabled.
-- Enable clears "disabled" only: a running cooldown still holds.
--
-- KEYS[1]  members ZSET: key_id -> key_id
-- KEYS[2]  the key's config HASH
-- ARGV[1]  key_id
-- ARGV[2]  action: cooldown | disable | enable
-- ARGV[3]  cooldown length in microseconds (cooldown only)
-- Returns  0 when the key is not in the pool; for cooldown the cooldown end in microseconds;
--          otherwise 1.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return 0
end
local action = ARGV[2]
if action == 'disable' then
  redis.call('HSET', KEYS[2], 'status', 'disabled')
  return 1
end
local status = redis.call('HGET', KEYS[2], 'status')
if action == 'enable' then
  local cool = tonumber(redis.call('HGET', KEYS[2], 'cool_until')) or 0
  redis.call('HSET', KEYS[2], 'status', cool > now and 'cooling' or 'active')
  return 1
end
if action == 'cooldown' then
  local cool = math.max(now + tonumber(ARGV[3]),
    tonumber(redis.call('HGET', KEYS[2], 'cool_until')) or 0)
  redis.call('HSET', KEYS[2], 'cool_until', cool)
  if status ~= 'disabled' then
    redis.call('HSET', KEYS[2], 'status', 'cooling')
  end
  return cool
end
return redis.error_reply('unknown key action: ' .. tostring(action))
