-- commit.lua: make a reserved turn durable, exactly once.
-- KEYS[1..5] = state, log, paths, res, done of one conversation (cpmemory/stores/keys.py)
-- ARGV[1] = conversation TTL in ms (0 = none)   ARGV[2] = reservation id
-- ARGV[3] = raw tenant id   ARGV[4] = raw conversation id (kept in state for inspection only)
-- ARGV[5] = search path JSON   ARGV[6] = m, the number of log entries (1: the turn's messages as one JSON array)
-- ARGV[7 .. 6+m] = log entries   ARGV[7+m] = s, the number of shown blocks
-- then s triplets: "s:<content hash>", seen payload ("<byte length of label>:<label><block id>"), "i:<block id>"
-- then: the turn's shown fields ("<byte length>:<field>" for each "s:<hash>" and "i:<id>", kept as "t:<turn>" so a
-- trim finds them), the cap on stored turns, and trim_before (turns up to it may be dropped).
-- After the append, the oldest turns beyond the cap and up to trim_before (never this turn) are dropped from the log
-- and the paths, with the seen entries last shown in them (and the ids pointing at those): see trim_turns.
-- Returns the committed turn number (>= 1); the same number again for a reservation already committed;
-- -1 for an unknown reservation; -2 for an expired one (nothing is recorded in either case).
-- Shown blocks are recorded under the turn number assigned here (not the one guessed at reserve time).

local now = now_ms()
local id = ARGV[2]
local done = redis.call('ZSCORE', KEYS[5], id)
if done then
  refresh_ttl(nil)
  return tonumber(done)
end
if redis.call('ZSCORE', KEYS[5], 'x:' .. id) then
  return -2
end
local deadline = redis.call('ZSCORE', KEYS[4], id)
if not deadline then
  return -1
end
if tonumber(deadline) < now then
  purge_expired(now)
  return -2
end

local turn = redis.call('HINCRBY', KEYS[1], 'turns', 1)
local m = tonumber(ARGV[6])
if m > 0 then
  redis.call('RPUSH', KEYS[2], unpack(ARGV, 7, 6 + m))
end
local fields = {'tenant', ARGV[3], 'conversation', ARGV[4], 'path', ARGV[5]}
local base = 7 + m
local shown_count = tonumber(ARGV[base])
local tail = base + 3 * shown_count
if shown_count > 0 then
  fields[#fields + 1] = 't:' .. turn
  fields[#fields + 1] = ARGV[tail + 1]
end
for i = 0, shown_count - 1 do
  local at = base + 3 * i
  local hash_field = ARGV[at + 1]
  fields[#fields + 1] = hash_field
  fields[#fields + 1] = turn .. ':' .. ARGV[at + 2]
  fields[#fields + 1] = ARGV[at + 3]
  fields[#fields + 1] = string.sub(hash_field, 3)
end
for start = 1, #fields, 1000 do  -- one HSET per 500 fields (unpack takes a few thousand values at most)
  redis.call('HSET', KEYS[1], unpack(fields, start, math.min(start + 999, #fields)))
end
redis.call('RPUSH', KEYS[3], ARGV[5])
trim_turns(turn, tonumber(ARGV[tail + 2]), tonumber(ARGV[tail + 3]))
redis.call('ZREM', KEYS[4], id)
remember(id, turn)
purge_expired(now)
refresh_ttl(nil)
return turn
