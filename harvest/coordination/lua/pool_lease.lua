-- Lease up to N keys from a pool, atomically with one rate permit per lease.
-- Usable key: not disabled, no cooldown running (a cooling key whose cooldown is over is active
-- again by itself), live leases < max (expired ones are not counted), and its sliding
-- rate window (now - period, now] holds fewer than rate_n grants, and (when the call declares a
-- cost and the key a token budget) its token window (now - tpm period, now] holds at most
-- tpm - cost tokens (reservations of live calls at their declared cost, ended calls at what they
-- used: see pool_release.lua). Each lease goes to the least
-- loaded usable key (live / max); ties go to the first key in a rotating order (round robin,
-- the cursor advances on every call).
-- Per-key names are <prefix>key:<id>, <prefix>leases:<id>, <prefix>rate:<id>,
-- <prefix>tokens:<id> (see keys.py). A token window entry is the member "<fence>:<tokens>" scored
-- with its grant time. A key whose budget is below the cost can never admit it: it is skipped.
-- Learned limits (see pool_key_admin.lua "throttle" and pool_release.lua): a key admits by its
-- effective concurrency and rate (eff_max, eff_rate: the declared ones lowered after 429s, never
-- above them, at least 1), and while the service's last announcement (ann_req / ann_tok, from its
-- rate-limit headers) runs, by what it said was left: each grant takes one request and the cost
-- from it, and at 0 the key waits for the announced reset.
--
-- KEYS[1]  epoch STRING (absent: pool not loaded)
-- KEYS[2]  members ZSET: key_id -> key_id
-- KEYS[3]  cursor STRING (INCR)
-- KEYS[4]  fence counter STRING (INCR per lease; a missing counter starts at the Redis time in
--          microseconds, so fences keep increasing across a Redis restart)
-- ARGV[1]  pool prefix (keys.pool_prefix)
-- ARGV[2]  lease ttl in microseconds
-- ARGV[3]  tokens each call will cost (0: no token check)
-- ARGV[4]  a key to try first for a single lease (0: none): the key a release just freed, in
--          the same pipeline (a hand-off, see key_pool.py _handoff). If it admits the call it
--          is granted without reading the rest of the pool: the hand-off leaves every key's
--          load as it was (the slot freed is taken again); otherwise the pool is scanned.
-- ARGV[5]  milliseconds the pool stays wanted when fewer leases than asked are granted: a
--          STRING <prefix>wanted, whose presence makes a release wake a waiting process at once
--          (see pool_release.lua); 0: do not mark it
-- ARGV[6..] one token per lease wanted
-- Returns  {-1} when the pool is not loaded; otherwise
--          {granted, retry_after_us, key_id_1, fence_1, expires_at_us_1, plain_1, key_id_2, ...}
--          where plain is 1 when the key has no rate limit, no token budget, no learned limit
--          below its declared concurrency and no announcement running (a lease of such a key
--          may pass from a call to the next in its process without asking again: see
--          sync_shell.py), else 0
--          where retry_after_us (when fewer than wanted were granted) is the time until a key
--          could be usable again (earliest lease expiry, cooldown end, rate or token window slide),
--          -1 when time alone frees nothing (no keys, or all disabled), -2 when the cost is above
--          every key's token budget (no key could ever admit it), 0 when all were granted.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {-1}
end
local prefix = ARGV[1]
local ttl = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local prefer = ARGV[4]
local wanted_ms = tonumber(ARGV[5])
local FIRST = 6 -- ARGV index of the first token
local retry = -1
local fits = false -- some key's budget (whatever its status) could hold one such call
local seen = 0 -- keys with a config
local live_from = string.format('(%.0f', now) -- a lease is live while its expiry is ahead

local function sooner(wait)
  if retry < 0 or wait < retry then
    retry = wait
  end
end

-- the effective limit: the declared one, or the learned one below it (at least 1)
local function learned(declared, eff)
  eff = tonumber(eff)
  if eff == nil then
    return declared
  end
  return math.max(1, math.min(declared, math.floor(eff)))
end

-- what the service said is left, while its reset is ahead (nil: nothing announced now)
local function announced(left, until_us)
  until_us = tonumber(until_us) or 0
  if until_us <= now then
    return nil, 0
  end
  return tonumber(left), until_us
end

-- A key at its concurrency admits nothing whatever its rate and tokens, which are then not read
-- (at a full pool that is most keys) unless its wait is needed (see wait_for).
local load_rest
local function load_key(id)
  local config = prefix .. 'key:' .. id
  local c = redis.call('HMGET', config, 'max', 'status', 'cool_until', 'tpm', 'eff_max')
  if not c[1] then
    return nil
  end
  seen = seen + 1
  local tpm = tonumber(c[4]) or 0
  if cost == 0 or tpm == 0 or tpm >= cost then
    fits = true
  end
  if c[2] == 'disabled' then
    return nil
  end
  local cool = tonumber(c[3]) or 0
  if cool > now then
    sooner(cool - now)
    return nil
  end
  if cost > 0 and tpm > 0 and cost > tpm then
    return nil -- this key's budget can never hold one such call
  end
  local k = {id = id, max = learned(tonumber(c[1]), c[5]), leases = prefix .. 'leases:' .. id,
    lowered = learned(tonumber(c[1]), c[5]) < tonumber(c[1]),
    config = config, budget = tpm, rate_n = 0, used = 0, tpm = 0, spent = 0, entries = {}}
  k.live = redis.call('ZCOUNT', k.leases, live_from, '+inf')
  if k.live >= k.max then
    k.partial = true -- see wait_for
    return k
  end
  return load_rest(k)
end

-- The rest of a key: its rate window, token window and what the service announced.
load_rest = function(k)
  k.partial = false
  local id, config = k.id, k.config
  local d = redis.call('HMGET', config, 'rate_n', 'rate_us', 'tpm_us', 'eff_rate',
    'ann_req', 'ann_req_until', 'ann_tok', 'ann_tok_until')
  k.rate_n, k.rate_us, k.tpm, k.tpm_us = tonumber(d[1]) or 0, tonumber(d[2]) or 0, k.budget,
    tonumber(d[3]) or 0
  k.rate, k.tokens = prefix .. 'rate:' .. id, prefix .. 'tokens:' .. id
  if k.rate_n > 0 then
    k.rate_n = learned(k.rate_n, d[4])
  end
  k.ann_req, k.ann_req_until = announced(d[5], d[6])
  k.ann_tok, k.ann_tok_until = announced(d[7], d[8])
  if k.rate_n > 0 then
    k.rate_from = string.format('(%.0f', now - k.rate_us)
    k.used = redis.call('ZCOUNT', k.rate, k.rate_from, '+inf')
  end
  if cost > 0 and k.tpm > 0 then
    redis.call('ZREMRANGEBYSCORE', k.tokens, '-inf', now - k.tpm_us)
    k.entries = redis.call('ZRANGE', k.tokens, 0, -1, 'WITHSCORES')
    for i = 1, #k.entries, 2 do
      k.spent = k.spent + tonumber(string.match(k.entries[i], ':(%d+)$'))
    end
  end
  return k
end

local function admits(k)
  return k.live < k.max and (k.rate_n == 0 or k.used < k.rate_n)
    and (cost == 0 or k.tpm == 0 or k.spent + cost <= k.tpm)
    and (k.ann_req == nil or k.ann_req > 0)
    and (k.ann_tok == nil or k.ann_tok >= math.max(cost, 1))
end

-- The keys, from the cursor on. For one lease, the scan stops at the first idle key that admits
-- it: none can be less loaded, and ties go to the first in this order anyway.
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
      if #ARGV == FIRST and k.live == 0 and admits(k) then
        break
      end
    end
  end
  return found
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

local function plain(k)
  if k.rate_n == 0 and k.budget == 0 and not k.lowered and k.ann_req == nil
      and k.ann_tok == nil then
    return 1
  end
  return 0
end

local function next_fence()
  if redis.call('EXISTS', KEYS[4]) == 0 then
    redis.call('SET', KEYS[4], t[1] .. string.format('%06d', tonumber(t[2])))
  end
  return redis.call('INCR', KEYS[4])
end

-- Expired leases and grants out of the rate window are counted out by score where the keys are
-- read (ZCOUNT), and removed only from the key granted here: a pool's scan writes nothing.
local function grant(k, token)
  local fence = next_fence()
  redis.call('ZREMRANGEBYSCORE', k.leases, '-inf', now)
  redis.call('ZADD', k.leases, now + ttl, token)
  k.live = k.live + 1
  if k.rate_n > 0 then
    redis.call('ZREMRANGEBYSCORE', k.rate, '-inf', now - k.rate_us)
    redis.call('ZADD', k.rate, now, fence)
    k.used = k.used + 1
  end
  if cost > 0 and k.tpm > 0 then
    local member = string.format('%.0f:%.0f', fence, cost) -- not tostring: 14 digits only
    redis.call('ZADD', k.tokens, now, member)
    k.spent = k.spent + cost
    -- entries stay in time order: this grant is the latest
    table.insert(k.entries, member)
    table.insert(k.entries, string.format('%.0f', now))
  end
  if k.ann_req ~= nil then
    k.ann_req = k.ann_req - 1
    redis.call('HSET', k.config, 'ann_req', k.ann_req)
  end
  if k.ann_tok ~= nil then
    k.ann_tok = k.ann_tok - cost
    redis.call('HSET', k.config, 'ann_tok', k.ann_tok)
  end
  return fence
end

local function wait_for(k)
  local wait = 0
  if k.live >= k.max then
    local e = redis.call('ZRANGEBYSCORE', k.leases, live_from, '+inf', 'WITHSCORES',
      'LIMIT', k.live - k.max, 1)
    wait = tonumber(e[2]) - now
    if k.partial then
      if retry >= 0 and wait >= retry then
        return wait -- its whole wait is no sooner than one already found: not read
      end
      load_rest(k)
    end
  end
  if k.rate_n > 0 and k.used >= k.rate_n then
    local r = redis.call('ZRANGEBYSCORE', k.rate, k.rate_from, '+inf', 'WITHSCORES',
      'LIMIT', k.used - k.rate_n, 1)
    wait = math.max(wait, tonumber(r[2]) + k.rate_us - now)
  end
  if cost > 0 and k.tpm > 0 and k.spent + cost > k.tpm then
    local freed = 0
    for i = 1, #k.entries, 2 do
      freed = freed + tonumber(string.match(k.entries[i], ':(%d+)$'))
      if k.spent - freed + cost <= k.tpm then
        wait = math.max(wait, tonumber(k.entries[i + 1]) + k.tpm_us - now)
        break
      end
    end
  end
  if k.ann_req ~= nil and k.ann_req <= 0 then
    wait = math.max(wait, k.ann_req_until - now)
  end
  if k.ann_tok ~= nil and k.ann_tok < math.max(cost, 1) then
    wait = math.max(wait, k.ann_tok_until - now)
  end
  return wait
end

-- A hand-off: the key just freed, when it admits the call (O(1) where a scan reads every key).
if prefer ~= '0' and #ARGV == FIRST and redis.call('ZSCORE', KEYS[2], prefer) then
  local k = load_key(prefer)
  if k and not k.partial and admits(k) then
    local flag = plain(k)
    local fence = grant(k, ARGV[FIRST])
    return {1, 0, tonumber(k.id), fence, now + ttl, flag}
  end
end

local keys = load_usable()
local out = {0, 0}
for i = FIRST, #ARGV do
  local k = pick(keys)
  if k == nil then
    break
  end
  local flag = plain(k)
  local fence = grant(k, ARGV[i])
  out[1] = out[1] + 1
  table.insert(out, tonumber(k.id))
  table.insert(out, fence)
  table.insert(out, now + ttl)
  table.insert(out, flag)
end
if out[1] < #ARGV - FIRST + 1 then
  if wanted_ms > 0 then
    redis.call('SET', prefix .. 'wanted', '1', 'PX', wanted_ms)
  end
  for _, k in ipairs(keys) do
    sooner(wait_for(k))
  end
  out[2] = retry
  if out[1] == 0 and not fits and seen > 0 then
    out[2] = -2
  end
end
return out
