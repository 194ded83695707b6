-- Read a key pool's live state in one consistent view (read only: counts live leases and rate
-- grants by time instead of purging). Per-key names as in keys.py.
--
-- KEYS[1]  epoch STRING (absent: pool not loaded)
-- KEYS[2]  members ZSET: key_id -> key_id
-- ARGV[1]  pool prefix (keys.pool_prefix)
-- Returns  {-1} when the pool is not loaded; otherwise {epoch, now_us, then 11 values per key:
--          key_id, effective status (active|cooling|disabled), live leases, max_concurrency,
--          cooldown end in us (0 = none running), rate_n, rate period in us, rate grants in window,
--          tpm (0 = no token budget), token window in us, tokens in its window (reserved or used),
--          effective max_concurrency, effective rate_n (both as pool_lease.lua admits by: the
--          declared ones, or lower after 429s), requests and tokens the service announced left
--          (-1: no announcement running), times its limits were lowered}
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
    'max', 'rate_n', 'rate_us', 'status', 'cool_until', 'tpm', 'tpm_us',
    'eff_max', 'eff_rate', 'ann_req', 'ann_req_until', 'ann_tok', 'ann_tok_until', 'lowered')
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
  local tpm = tonumber(c[6]) or 0
  local tpm_us = tonumber(c[7]) or 0
  local spent = 0
  if tpm > 0 then
    local entries = redis.call('ZRANGEBYSCORE', prefix .. 'tokens:' .. id,
      string.format('(%.0f', now - tpm_us), '+inf')
    for _, e in ipairs(entries) do
      spent = spent + tonumber(string.match(e, ':(%d+)$'))
    end
  end
  local max = tonumber(c[1]) or 0
  local eff_max, eff_rate = max, rate_n
  if c[8] then
    eff_max = math.max(1, math.min(max, math.floor(tonumber(c[8]))))
  end
  if c[9] and rate_n > 0 then
    eff_rate = math.max(1, math.min(rate_n, math.floor(tonumber(c[9]))))
  end
  local ann_req, ann_tok = -1, -1
  if (tonumber(c[11]) or 0) > now then
    ann_req = math.max(0, tonumber(c[10]))
  end
  if (tonumber(c[13]) or 0) > now then
    ann_tok = math.max(0, tonumber(c[12]))
  end
  for _, v in ipairs({tonumber(id), status, live, max, cool, rate_n, rate_us, used,
      tpm, tpm_us, spent, eff_max, eff_rate, ann_req, ann_tok, tonumber(c[14]) or 0}) do
    table.insert(out, v)
  end
end
return out
