-- load.lua: read a whole conversation (inspection and tests; not on the hot path). O(size of the state).
-- KEYS[1..5] = state, log, paths, res, done of one conversation (cpmemory/stores/keys.py)
-- ARGV[1] = conversation TTL in ms (0 = none)
-- Returns {state hash (flat field/value list), transcript list, search path list, open reservation count}.

local now = now_ms()
local purged = purge_expired(now)
local result = {
  redis.call('HGETALL', KEYS[1]),
  redis.call('LRANGE', KEYS[2], 0, -1),
  redis.call('LRANGE', KEYS[3], 0, -1),
  redis.call('ZCARD', KEYS[4]),
}
if purged then
  refresh_ttl(nil)
else
  refresh_ttl(4)
end
return result
