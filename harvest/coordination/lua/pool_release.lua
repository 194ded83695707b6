-- Free one lease of a pool key, only for its own token, and settle its token reservation.
-- The reservation "<fence>:<reserved>" (see pool_lease.lua) becomes "<fence>:<used>" at its grant
-- time: more used is charged, less is refunded, but only by a live holder (a lease that died
-- keeps its reservation until the window passes it). A call that reserved nothing and reports
-- tokens on a key with a budget is charged from now. A reservation the window already passed is
-- left alone. used < 0: nothing reported, the reservation stands as charged.
--
-- Learning (see pool_key_admin.lua "throttle"): a call that succeeded grows the key's lowered
-- effective limits back (additive increase): by recover x the declared limit up to the safe level
-- (below the one that last failed), by step x the declared limit above it; at the declared limit
-- the learned value is dropped. The service's rate-limit headers, when the call reported them,
-- become the key's announced state: requests and tokens left until now + their reset.
--
-- KEYS[1]  the key's leases ZSET: token -> expiry (microseconds, Redis clock)
-- KEYS[2]  the key's token window ZSET: "<fence>:<tokens>" -> grant time (microseconds)
-- KEYS[3]  the key's config HASH (tpm: 0 or absent = no token budget; tpm_us its window)
-- KEYS[4]  the pool's wanted STRING, KEYS[5] its freed LIST (keys.pool_wanted, pool_freed)
-- ARGV[1]  lease token
-- ARGV[2]  the lease's fence
-- ARGV[3]  tokens reserved at the lease (0: none)
-- ARGV[4]  tokens the call used (-1: not reported)
-- ARGV[5]  1 when the call succeeded (grow the learned limits back), else 0
-- ARGV[6]  recover, ARGV[7] step: fractions of the declared limit added per success
-- ARGV[8..11] announced: requests left, their reset in microseconds, tokens left, their reset
--          (-1: not announced)
-- ARGV[12] milliseconds to keep a wake-up: when the lease was live and the pool is wanted (a
--          lease try found no key in the last moments: jobs wait somewhere), the key id is
--          pushed on the freed list, which a waiting process pops (BLPOP) to try a lease at
--          once rather than at its next poll; the list keeps 64 ids at most, for this long.
--          0: no wake-up (a release whose own pipeline leases the slot it frees)
-- Returns  1 when a live lease was freed; 0 when it was already lost (expired, reclaimed, or the
--          key left the pool). The token is removed either way.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
local live = expiry and tonumber(expiry) > now
local reserved = tonumber(ARGV[3])
local used = tonumber(ARGV[4])
local budget = redis.call('HMGET', KEYS[3], 'tpm', 'tpm_us')
if used >= 0 and (tonumber(budget[1]) or 0) > 0 then
  -- purge here too: calls with no cost never lease through the token check
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - (tonumber(budget[2]) or 0))
  local member = ARGV[2] .. ':' .. ARGV[3]
  local at = redis.call('ZSCORE', KEYS[2], member)
  if at and used ~= reserved and (live or used > reserved) then
    redis.call('ZREM', KEYS[2], member)
    redis.call('ZADD', KEYS[2], at, ARGV[2] .. ':' .. ARGV[4])
  elseif not at and reserved == 0 and used > 0 then
    redis.call('ZADD', KEYS[2], now, ARGV[2] .. ':' .. ARGV[4])
  end
end

local function grow(declared, eff_field, safe_field)
  local c = redis.call('HMGET', KEYS[3], eff_field, safe_field)
  local eff = tonumber(c[1])
  if eff == nil or declared <= 0 then
    return
  end
  local safe = tonumber(c[2]) or declared
  if eff < safe then
    eff = math.min(safe, eff + declared * tonumber(ARGV[6]))
  else
    eff = eff + declared * tonumber(ARGV[7])
  end
  if eff >= declared then
    redis.call('HDEL', KEYS[3], eff_field, safe_field)
  else
    redis.call('HSET', KEYS[3], eff_field, string.format('%.6f', eff))
  end
end

local declared = redis.call('HMGET', KEYS[3], 'max', 'rate_n')
if ARGV[5] == '1' and declared[1] then
  grow(tonumber(declared[1]), 'eff_max', 'safe_max')
  grow(tonumber(declared[2]) or 0, 'eff_rate', 'safe_rate')
end
if declared[1] then
  for i, name in ipairs({'ann_req', 'ann_tok'}) do
    local left = tonumber(ARGV[6 + i * 2])
    if left >= 0 then
      redis.call('HSET', KEYS[3], name, left, name .. '_until',
        string.format('%.0f', now + tonumber(ARGV[7 + i * 2])))
    end
  end
end
if live then
  local wake = tonumber(ARGV[12]) or 0
  if wake > 0 and redis.call('EXISTS', KEYS[4]) == 1 then
    local id = string.match(KEYS[3], '(%d+)$')
    redis.call('LPUSH', KEYS[5], id)
    redis.call('LTRIM', KEYS[5], 0, 63)
    redis.call('PEXPIRE', KEYS[5], wake)
  end
  return 1
end
return 0
