-- abort.lua: release an open reservation (idempotent).
-- KEYS[1..5] = state, log, paths, res, done of one conversation (cpmemory/stores/keys.py)
-- ARGV[1] = conversation TTL in ms (0 = none)   ARGV[2] = reservation id
-- Returns 1 when an open reservation was released, 0 otherwise (unknown, committed, expired or aborted before).

local now = now_ms()
local purged = purge_expired(now)
local removed = redis.call('ZREM', KEYS[4], ARGV[2])
if purged then
  refresh_ttl(nil)
else
  refresh_ttl(4)
end
return removed
