-- The live execution processes, judged by the Redis clock; expired ones are purged.
--
-- KEYS[1]  index ZSET: worker id -> expiry (Redis time, milliseconds)
-- ARGV[1]  the info key prefix (keys.worker_info of an empty id)
-- Returns  {now_ms, id_1, {field, value, ...}, id_2, {...}, ...}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local out = {now}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local info = redis.call('HGETALL', ARGV[1] .. id)
  if #info > 0 then
    table.insert(out, id)
    table.insert(out, info)
  end
end
return out
