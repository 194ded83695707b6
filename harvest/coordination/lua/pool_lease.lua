-- Lease up to N keys from a pool, atomically with one rate permit per lease.
-- Usable key: not disabled, no cooldown running (a cooling key whose cooldown is over is active
-- again by itself), live leases < max (expired leases are purged here first), and its sliding
-- rate window (now - period, now] holds fewer than rate_n grants. Each lease goes to the least
-- loaded usable key (live / max); ties go to the first key in a rotating order (round robin,
-- the cursor advances on every call).
-- Per-key names are <prefix>key:<id>, <prefix>leases:<id>, <prefix>rate:<id> (see keys.py).
--
-- KEYS[1]  epoch STRING (absent: pool not loaded)
-- KEYS[2]  members ZSET: key_id -> key_id
-- KEYS[3]  cursor STRING (INCR)
-- KEYS[4]  fence counter STRING (INCR per lease; a missing counter starts at the Redis time in
--          microseconds, so fences keep increasing across a Redis restart)
-- ARGV[1]  pool prefix (keys.pool_prefix)
-- ARGV[2]  lease ttl in microseconds
-- ARGV[3..] one token per lease wanted
-- Returns  {-1} when the pool is not loaded; otherwise
--          {granted, retry_after_us, key_id_1, fence_1, expires_at_us_1, key_id_2, ...}
--          where retry_after_us (when fewer than wanted were granted) is the time until a key
--          could be usable again (earliest lease expiry, cooldown end or rate window slide),
--          -1 when time alone frees nothing (no keys, or all disabled), 0 when all were granted.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {-1}
end
local prefix = ARGV[1]
local ttl = tonumber(ARGV[2])
local retry = -1

local function sooner(wait)
  if retry < 0 or wait < retry then
    retry = wait
  end
end

local function load_key(id)
  local c = redis.call('HMGET', prefix .. 'key:' .. id,
    'max', 'rate_n', 'rate_us', 'status', 'cool_until')
  if c[4] == 'disabled' or not c[1] then
    return nil
  end
  local cool = tonumber(c[5]) or 0
  if cool > now then
    sooner(cool - now)
    return nil
  end
  local k = {id = id, max = tonumber(c[1]), rate_n = tonumber(c[2]) or 0,
    rate_us = tonumber(c[3]) or 0, leases = prefix .. 'leases:' .. id,
    rate = prefix .. 'rate:' .. id, used = 0}
  redis.call('ZREMRANGEBYSCORE', k.leases, '-inf', now)
  k.live = redis.call('ZCARD', k.leases)
  if k.rate_n > 0 then
    redis.call('ZREMRANGEBYSCORE', k.rate, '-inf', now - k.rate_us)
    k.used = redis.call('ZCARD', k.rate)
  end
  return k
end

local function load_usable()
  local ids = redis.call('ZRANGE', KEYS[2], 0, -1)
  local n = #ids
  local found = {}
  if n == 0 then
    return found
  end
  local start = redis.call('INCR', KEYS[3]) % n
  for i = 0, n - 1 do
    local k = load_key(ids[(start + i) % n + 1])
    if k then
      table.insert(found, k)
    end
  end
  return found
end

local function admits(k)
  return k.live < k.max and (k.rate_n == 0 or k.used < k.rate_n)
end

local function pick(keys)
  local best = nil
  for _, k in ipairs(keys) do
    if admits(k) and (best == nil or k.live * best.max < best.live * k.max) then
      best = k
    end
  end
  return best
end

local function next_fence()
  if redis.call('EXISTS', KEYS[4]) == 0 then
    redis.call('SET', KEYS[4], t[1] .. string.format('%06d', tonumber(t[2])))
  end
  return redis.call('INCR', KEYS[4])
end

local function grant(k, token)
  local fence = next_fence()
  redis.call('ZADD', k.leases, now + ttl, token)
  k.live = k.live + 1
  if k.rate_n > 0 then
    redis.call('ZADD', k.rate, now, fence)
    k.used = k.used + 1
  end
  return fence
end

local function wait_for(k)
  local wait = 0
  if k.live >= k.max then
    local e = redis.call('ZRANGE', k.leases, k.live - k.max, k.live - k.max, 'WITHSCORES')
    wait = tonumber(e[2]) - now
  end
  if k.rate_n > 0 and k.used >= k.rate_n then
    local r = redis.call('ZRANGE', k.rate, k.used - k.rate_n, k.used - k.rate_n, 'WITHSCORES')
    wait = math.max(wait, tonumber(r[2]) + k.rate_us - now)
  end
  return wait
end

local keys = load_usable()
local out = {0, 0}
for i = 3, #ARGV do
  local k = pick(keys)
  if k == nil then
    break
  end
  local fence = grant(k, ARGV[i])
  out[1] = out[1] + 1
  table.insert(out, tonumber(k.id))
  table.insert(out, fence)
  table.insert(out, now + ttl)
end
if out[1] < #ARGV - 2 then
  for _, k in ipairs(keys) do
    sooner(wait_for(k))
  end
  out[2] = retry
end
return out
