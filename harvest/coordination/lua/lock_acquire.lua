-- Acquire a lock, or renew it when the caller already owns it.
-- A new acquisition takes the next fencing number (INCR); a renewal keeps the current one.
-- A missing fence counter (new lock, or Redis lost its data) starts at the Redis time in
-- microseconds, so fencing numbers keep increasing across a Redis restart.
--
-- KEYS[1]  lock STRING: the owner's token, with a PX expiry
-- KEYS[2]  fence counter STRING (INCR on every acquisition)
-- ARGV[1]  token of the caller
-- ARGV[2]  ttl in milliseconds
-- Returns  {fence, 1} when newly acquired; {fence, 0} when renewed (already the owner);
--          {0, pttl_ms} when another owner holds it (pttl_ms: its remaining time to live).
local function next_fence()
  if redis.call('EXISTS', KEYS[2]) == 0 then
    local t = redis.call('TIME')
    redis.call('SET', KEYS[2], t[1] .. string.format('%06d', tonumber(t[2])))
  end
  return redis.call('INCR', KEYS[2])
end

local owner = redis.call('GET', KEYS[1])
if owner == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {tonumber(redis.call('GET', KEYS[2])) or next_fence(), 0}
end
if owner then
  return {0, redis.call('PTTL', KEYS[1])}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {next_fence(), 1}
