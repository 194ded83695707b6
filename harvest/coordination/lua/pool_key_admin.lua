-- Change the state of one pool key: cooldown (429 / Retry-After), throttle (a 429 on a lease:
-- cooldown, and learn), disable, enable or uncool.
-- A cooldown never shortens a running one, and leaves a disabled key disabled.
-- Enable clears "disabled" only: a running cooldown still holds.
-- Uncool ends a running cooldown (an operator's enable), and leaves a disabled key disabled.
--
-- Throttle is a cooldown that also lowers the key's effective limits (multiplicative decrease)
-- when its declared limits said there was room for the call that got the 429: no more leases
-- live than its max_concurrency, its rate and token windows not full, and neither the 429's own
-- rate-limit headers nor the last ones announced (still running) said nothing was left. Then
-- eff_max (and eff_rate, for a key with a rate) become beta x what they were (at least 1), and
-- safe_max / safe_rate the level below the one that failed (pool_release.lua grows back fast to
-- it, slowly above). A 429 on a lease granted before the last decrease (its fence is not above
-- dec_fence) was sent under the old limit: it cools the key but lowers nothing again.
--
-- KEYS[1]  members ZSET: key_id -> key_id
-- KEYS[2]  the key's config HASH
-- KEYS[3..6] throttle only: the pool's fence counter STRING, the key's leases ZSET, rate window
--          ZSET and token window ZSET
-- ARGV[1]  key_id
-- ARGV[2]  action: cooldown | throttle | disable | enable | uncool
-- ARGV[3]  cooldown length in microseconds (cooldown and throttle)
-- ARGV[4..6] throttle only: the lease's fence, beta (0 < beta < 1), and 1 when the 429's
--          headers said nothing was left (requests or tokens), else 0
-- Returns  0 when the key is not in the pool; for cooldown the cooldown end in microseconds;
--          for throttle {cooldown end, 1 when the limits were lowered else 0, effective
--          max_concurrency, effective rate_n (0: no rate)}; otherwise 1.
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
if action == 'uncool' then
  redis.call('HSET', KEYS[2], 'cool_until', 0)
  if status ~= 'disabled' then
    redis.call('HSET', KEYS[2], 'status', 'active')
  end
  return 1
end

local function cooldown()
  local cool = math.max(now + tonumber(ARGV[3]),
    tonumber(redis.call('HGET', KEYS[2], 'cool_until')) or 0)
  redis.call('HSET', KEYS[2], 'cool_until', cool)
  if status ~= 'disabled' then
    redis.call('HSET', KEYS[2], 'status', 'cooling')
  end
  return cool
end

if action == 'cooldown' then
  return cooldown()
end

-- the declared limits had room: the 429 says the key's real limit is lower
local function room(c)
  if ARGV[6] == '1' then
    return false
  end
  local max, rate_n, tpm = tonumber(c[1]), tonumber(c[2]) or 0, tonumber(c[4]) or 0
  if redis.call('ZCOUNT', KEYS[4], string.format('(%.0f', now), '+inf') > max then
    return false
  end
  if rate_n > 0 and redis.call('ZCOUNT', KEYS[5],
      string.format('(%.0f', now - (tonumber(c[3]) or 0)), '+inf') >= rate_n then
    return false
  end
  if tpm > 0 then
    local spent = 0
    for _, e in ipairs(redis.call('ZRANGEBYSCORE', KEYS[6],
        string.format('(%.0f', now - (tonumber(c[5]) or 0)), '+inf')) do
      spent = spent + tonumber(string.match(e, ':(%d+)$'))
    end
    if spent >= tpm then
      return false
    end
  end
  for _, i in ipairs({9, 11}) do
    if (tonumber(c[i + 1]) or 0) > now and (tonumber(c[i]) or 1) <= 0 then
      return false
    end
  end
  return true
end

-- lower one limit: returns the new effective value (whole)
local function lower(declared, eff_field, safe_field, eff)
  local current = math.min(declared, tonumber(eff) or declared)
  local new = math.max(1, current * tonumber(ARGV[5]))
  redis.call('HSET', KEYS[2], eff_field, string.format('%.6f', new),
    safe_field, math.max(1, math.floor(current) - 1))
  return math.floor(new)
end

if action == 'throttle' then
  local cool = cooldown()
  local c = redis.call('HMGET', KEYS[2], 'max', 'rate_n', 'rate_us', 'tpm', 'tpm_us',
    'eff_max', 'eff_rate', 'dec_fence', 'ann_req', 'ann_req_until', 'ann_tok', 'ann_tok_until')
  local max, rate_n = tonumber(c[1]), tonumber(c[2]) or 0
  local eff_max = math.max(1, math.min(max, math.floor(tonumber(c[6]) or max)))
  local eff_rate = 0
  if rate_n > 0 then
    eff_rate = math.max(1, math.min(rate_n, math.floor(tonumber(c[7]) or rate_n)))
  end
  if tonumber(ARGV[4]) <= (tonumber(c[8]) or 0) or not room(c) then
    return {cool, 0, eff_max, eff_rate}
  end
  eff_max = lower(max, 'eff_max', 'safe_max', c[6])
  if rate_n > 0 then
    eff_rate = lower(rate_n, 'eff_rate', 'safe_rate', c[7])
  end
  redis.call('HSET', KEYS[2], 'dec_fence', redis.call('GET', KEYS[3]) or ARGV[4])
  redis.call('HINCRBY', KEYS[2], 'lowered', 1)
  return {cool, 1, eff_max, eff_rate}
end
return redis.error_reply('unknown key action: ' .. tostring(action))
