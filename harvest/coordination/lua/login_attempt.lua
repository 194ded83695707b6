-- One dashboard login attempt with Basic credentials (harvest.web.throttle), judged in one step.
-- While the address is locked nothing is judged or counted: the attempt is refused.
-- A right password marks the (user, address) pair known and clears the address's failures.
-- A wrong one counts against the address and the user; past the free failures the address is
-- locked for base * 2^(failures - free) ms (at most max). The free failures are fewer for an
-- address that is not known for this user while the user is under attack (many failures from
-- anywhere): per-user counts slow unknown addresses only, never lock the user out.
--
-- KEYS[1]  address failures STRING counter (EXPIRE window)
-- KEYS[2]  address lock STRING (PX)
-- KEYS[3]  user failures STRING counter (EXPIRE window)
-- KEYS[4]  known (user, address) STRING (EXPIRE known_ttl)
-- ARGV[1]  1 when the credentials were right, 0 when wrong
-- ARGV[2]  free failures per address
-- ARGV[3]  free failures per unknown address while the user is under attack
-- ARGV[4]  user failures (in the window) that put the user under attack
-- ARGV[5]  base lock in milliseconds
-- ARGV[6]  longest lock in milliseconds
-- ARGV[7]  window in seconds: failure counters expire after this long without a failure
-- ARGV[8]  seconds a known (user, address) pair is remembered
-- Returns  {0, pttl_ms}: locked, refused without judging;
--          {1, 0}: right, let in;
--          {2, lock_ms}: wrong, counted (lock_ms 0 when the address is not locked by it).
local pttl = redis.call('PTTL', KEYS[2])
if pttl > 0 then
  return {0, pttl}
end
if ARGV[1] == '1' then
  redis.call('SET', KEYS[4], '1', 'EX', ARGV[8])
  redis.call('DEL', KEYS[1])
  return {1, 0}
end
local window = tonumber(ARGV[7])
local failures = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], window)
local user_failures = redis.call('INCR', KEYS[3])
redis.call('EXPIRE', KEYS[3], window)
local free = tonumber(ARGV[2])
if user_failures >= tonumber(ARGV[4]) and redis.call('EXISTS', KEYS[4]) == 0 then
  free = math.min(free, tonumber(ARGV[3]))
end
if failures < free then
  return {2, 0}
end
local lock = tonumber(ARGV[5]) * 2 ^ math.min(failures - free, 40)
lock = math.floor(math.min(lock, tonumber(ARGV[6])))
redis.call('SET', KEYS[2], '1', 'PX', lock)
return {2, lock}
