-- common.lua: helpers prepended to every cpmemory script (not a script on its own).
-- Every script but decide.lua receives the five keys of ONE conversation (under its tenant's hash tag, so one
-- cluster slot):
--   KEYS[1] state (hash)  KEYS[2] log (list)  KEYS[3] paths (list)  KEYS[4] res (zset)  KEYS[5] done (zset)
-- and ARGV[1] = the conversation TTL in milliseconds (0 = no expiry), refreshed on every call: all five keys are
-- refreshed together unless they are within min(1% of the TTL, 60 s) of it (each redis.call costs microseconds, so
-- a hot reserve does one PTTL instead of five PEXPIREs).
-- Field layout of the state hash: see cpmemory/stores/keys.py.

local DONE_KEEP = 256  -- committed / expired reservation ids remembered for idempotent commits

-- Server time in milliseconds (scripts replicate by effects, so TIME is allowed).
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function committed_turns()
  return tonumber(redis.call('HGET', KEYS[1], 'turns') or '0')
end

-- Remember a reservation id (committed: its turn; expired: "x:" .. id) and forget the oldest beyond DONE_KEEP.
local function remember(member, score)
  redis.call('ZADD', KEYS[5], score, member)
  if redis.call('ZCARD', KEYS[5]) > DONE_KEEP then
    redis.call('ZREMRANGEBYRANK', KEYS[5], 0, -(DONE_KEEP + 1))
  end
end

-- Lazily turn reservations past their deadline into expired markers. O(expired). Returns true if any.
local function purge_expired(now)
  local expired = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', '(' .. now)
  if #expired == 0 then
    return false
  end
  local turns = committed_turns()
  for _, id in ipairs(expired) do
    remember('x:' .. id, turns)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. now)
  return true
end

-- Refresh the conversation's TTL. `probe` = index of a key the call wrote or kept (res): if its TTL is still within
-- min(1% of the TTL, 60 s) of full, the five keys (always refreshed together) are fresh enough and nothing is done;
-- otherwise, or when `probe` is nil, all five get the full TTL.
local function refresh_ttl(probe)
  local ttl = tonumber(ARGV[1])
  if ttl <= 0 then
    return
  end
  if probe and redis.call('PTTL', KEYS[probe]) >= ttl - math.min(math.floor(ttl / 100), 60000) then
    return
  end
  for i = 1, 5 do
    redis.call('PEXPIRE', KEYS[i], ttl)
  end
end

-- HMGET of the fields ARGV[first .. last], in chunks (Lua's unpack takes at most a few thousand values).
local function hmget_args(key, first, last)
  if last - first < 1000 then
    return redis.call('HMGET', key, unpack(ARGV, first, last))
  end
  local values = {}
  for start = first, last, 1000 do
    local part = redis.call('HMGET', key, unpack(ARGV, start, math.min(start + 999, last)))
    for i = 1, #part do
      values[#values + 1] = part[i]
    end
  end
  return values
end

-- Split "<n>:<n bytes><n>:<n bytes>..." into its strings.
local function split_prefixed(payload)
  local out, pos = {}, 1
  while pos <= #payload do
    local colon = string.find(payload, ':', pos, true)
    local size = tonumber(string.sub(payload, pos, colon - 1))
    out[#out + 1] = string.sub(payload, colon + 1, colon + size)
    pos = colon + size + 1
  end
  return out
end

-- The block id of a seen payload "<turn>:<label byte length>:<label><block id>".
local function seen_block_id(payload)
  local _, after_turn = string.find(payload, '^%d+:')
  local size_end = string.find(payload, ':', after_turn + 1, true)
  local size = tonumber(string.sub(payload, after_turn + 1, size_end - 1))
  return string.sub(payload, size_end + 1 + size)
end

-- Drop the stored turns beyond `cap` and up to `trim_before` (never `turn`, the one just appended) from the log and
-- the paths, with the seen entries last shown in a dropped turn and the id entries whose (id, text) no stored turn
-- shows any more. O(dropped blocks).
local function trim_turns(turn, cap, trim_before)
  local base = turn - redis.call('LLEN', KEYS[2])
  local upto = math.max(turn - cap, math.min(trim_before, turn - 1))
  if upto <= base then
    return
  end
  for t = base + 1, upto do
    local shown = redis.call('HGET', KEYS[1], 't:' .. t)
    if shown then
      local names = split_prefixed(shown)
      for i = 1, #names - 1, 2 do
        local seen = redis.call('HGET', KEYS[1], names[i])
        if seen and tonumber(string.match(seen, '^(%d+):')) == t then
          redis.call('HDEL', KEYS[1], names[i])
          seen = false
        end
        -- the id's entry goes unless a stored turn still shows this text under this id
        if redis.call('HGET', KEYS[1], names[i + 1]) == string.sub(names[i], 3)
            and (not seen or seen_block_id(seen) ~= string.sub(names[i + 1], 3)) then
          redis.call('HDEL', KEYS[1], names[i + 1])
        end
      end
      redis.call('HDEL', KEYS[1], 't:' .. t)
    end
  end
  redis.call('LTRIM', KEYS[2], upto - base, -1)
  redis.call('LTRIM', KEYS[3], upto - base, -1)
end
