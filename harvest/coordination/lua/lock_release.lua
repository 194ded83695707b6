-- Release a lock, only by its owner.
--
-- KEYS[1]  lock STRING: the owner's token, with a PX expiry
-- ARGV[1]  token of the caller
-- Returns  1 when released; 0 when the caller did not own the lock (expired or taken over).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
