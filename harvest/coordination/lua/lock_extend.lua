-- Extend a lock, only by its owner.
--
-- KEYS[1]  lock STRING: the owner's token, with a PX expiry
-- ARGV[1]  token of the caller
-- ARGV[2]  new ttl in milliseconds (from now)
-- Returns  1 when extended; 0 when the caller does not own the lock (expired or taken over).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
