-- reserve.lua: read the committed state one request needs and record a reservation, atomically.
-- KEYS[1..5] = state, log, paths, res, done of one conversation (cpmemory/stores/keys.py)
-- ARGV[1] = conversation TTL in ms (0 = none)        ARGV[2] = new reservation id
-- ARGV[3] = reservation timeout in ms
-- ARGV[4] = transcript: "-1" none, "0" every stored turn, N > 0 the turn window of N turns (max_history_turns)
-- ARGV[5 ..] = state fields to read: "turns", "path", then "s:<hash>" per block, then "i:<id>" per block
-- Returns {values of those fields (nil = absent), transcript entries (one JSON array of messages per turn) or nil,
--          the number of committed turns before the first entry returned}.
-- The log holds the last LLEN turns (older ones were trimmed by commit), so the read is O(window).
-- Only committed state is read: another open reservation's blocks are never visible.
-- Expired reservations are purged here on about one call in 16 (the id's first hex digit is 0); commit, abort
-- and load always purge, so the result of every call is the same, only the purge work is amortised.

local now = now_ms()
local purged = false
if string.sub(ARGV[2], 1, 1) == '0' then
  purged = purge_expired(now)
end
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[3]), ARGV[2])
local values = hmget_args(KEYS[1], 5, #ARGV)
local transcript = false
local start = 0
local window = tonumber(ARGV[4])
if window >= 0 then
  local turns = tonumber(values[1] or '0')
  local base = turns - redis.call('LLEN', KEYS[2])
  start = base
  if window > 0 and turns > window then
    start = math.max(base, math.floor((turns - 1) / window) * window)
  end
  transcript = redis.call('LRANGE', KEYS[2], start - base, -1)
end
if purged then
  refresh_ttl(nil)
else
  refresh_ttl(4)
end
return {values, transcript, start}
