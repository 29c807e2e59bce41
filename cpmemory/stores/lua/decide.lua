-- decide.lua: a tenant's online order state (cpmemory/core/online.py, the same rules), shared by every worker.
-- KEYS[1] cnt   (hash)  trie node id -> requests recorded through it;  node id .. "t" -> clock of its last use
--                       (node id = 16 hex digits of sha1(parent id .. "|" .. block), the root is "")
-- KEYS[2] post  (hash)  block -> ordinals ("#seen") of the last requests that retrieved it, comma separated
-- KEYS[3] freq  (hash)  block -> retrieval count; "#seen" requests observed, "#clock" requests recorded
-- KEYS[4] first (hash)  block -> the "#seen" ordinal of the request that first retrieved it
-- KEYS[5] reqs  (hash)  request id -> the node ids of its recorded order, comma separated
-- KEYS[6] fifo  (list)  recorded request ids, oldest first (bounds the state)
-- (one tenant hash tag: every key in one cluster slot)
-- ARGV[1] mode: "order" (observe + order), "record", "both" (order + record), "evict"
-- ARGV[2] TTL of the state in ms (0 none)     ARGV[3] max recorded requests     ARGV[4] max blocks counted
-- ARGV[5] request id (record / both; "" none)  ARGV[6] match budget   ARGV[7] recency scale
-- ARGV[8] requests kept per block posting
-- ARGV[9 ..] order / both: block, size pairs (the request's distinct blocks, relevance order);
--            record: the blocks in the order sent;  evict: request ids
-- Returns the order (order / both), the number of ids forgotten (record), or the number evicted (evict).
-- Cost: the match expands at most ARGV[6] nodes (one HMGET pair each); the extension intersects the request's
-- postings (read and written with one HMGET / HSET); record and evict are O(k).

local mode = ARGV[1]
local ttl = tonumber(ARGV[2])
local max_requests = tonumber(ARGV[3])
local max_blocks = tonumber(ARGV[4])
local request_id = ARGV[5]
local budget = tonumber(ARGV[6])
local scale = tonumber(ARGV[7])
local posting_length = tonumber(ARGV[8])
local FIRST_ARG = 9
local seen_count = 0
local postings = {}  -- block -> {ordinal = true} of the request being ordered (after observe)
local refresh_now = false

local function child_id(parent, block)
  return string.sub(redis.sha1hex(parent .. '|' .. block), 1, 16)
end

local function release(path)
  for id in string.gmatch(path, '[^,]+') do
    if redis.call('HINCRBY', KEYS[1], id, -1) <= 0 then
      redis.call('HDEL', KEYS[1], id, id .. 't')
    end
  end
end

local function evict(id)
  local path = redis.call('HGET', KEYS[5], id)
  if not path then
    return 0
  end
  redis.call('HDEL', KEYS[5], id)  -- its entry in the fifo is skipped when it comes out
  release(path)
  return 1
end

local function observe(blocks)
  if redis.call('HLEN', KEYS[3]) > max_blocks then  -- bounded: forget the popularity learnt so far
    redis.call('DEL', KEYS[3], KEYS[4], KEYS[2])
  end
  local ordinal = redis.call('HINCRBY', KEYS[3], '#seen', 1)
  refresh_now = refresh_now or ordinal == 1
  for i = 1, #blocks do
    redis.call('HINCRBY', KEYS[3], blocks[i], 1)
    redis.call('HSETNX', KEYS[4], blocks[i], ordinal)
  end
  if #blocks > 0 then
    local stored = redis.call('HMGET', KEYS[2], unpack(blocks))
    local fields = {}
    for i = 1, #blocks do
      local list = {}
      for value in string.gmatch(stored[i] or '', '[^,]+') do
        list[#list + 1] = value
      end
      list[#list + 1] = tostring(ordinal)
      while #list > posting_length do
        table.remove(list, 1)
      end
      local set = {}
      for j = 1, #list do
        set[tonumber(list[j])] = true
      end
      postings[blocks[i]] = set
      fields[#fields + 1] = blocks[i]
      fields[#fields + 1] = table.concat(list, ',')
    end
    redis.call('HSET', KEYS[2], unpack(fields))
  end
  return ordinal
end

-- Branch and bound over the recorded paths restricted to the request's blocks (core/online.py: match).
local function match(blocks, size, clock)
  local total = 0
  for i = 1, #blocks do
    total = total + size[blocks[i]]
  end
  local best_score, best_path = 0, {}
  local stack = {{'', 0, total, {}, {}}}  -- node id, score, size left, path blocks, path set
  while #stack > 0 and budget > 0 do
    local entry = table.remove(stack)
    local node, score, left, path, on_path = entry[1], entry[2], entry[3], entry[4], entry[5]
    if score + left > best_score then
      budget = budget - 1
      if score > best_score then
        best_score, best_path = score, path
      end
      local ids, fields, candidates = {}, {}, {}
      for i = 1, #blocks do
        if not on_path[blocks[i]] then
          local id = child_id(node, blocks[i])
          candidates[#candidates + 1] = blocks[i]
          ids[#ids + 1] = id
          fields[#fields + 1] = id
          fields[#fields + 1] = id .. 't'
        end
      end
      if #ids > 0 then
        local values = redis.call('HMGET', KEYS[1], unpack(fields))
        local scored = {}
        for i = 1, #ids do
          local count = values[2 * i - 1]
          if count and tonumber(count) > 0 then
            local block = candidates[i]
            local weight = size[block] / (1.0 + (clock - tonumber(values[2 * i] or '0')) / scale)
            scored[#scored + 1] = {score + weight, block, ids[i]}
          end
        end
        table.sort(scored, function(a, b)
          if a[1] ~= b[1] then return a[1] < b[1] end
          return a[2] < b[2]
        end)
        for i = 1, #scored do
          local block = scored[i][2]
          local next_path, next_set = {}, {}
          for j = 1, #path do
            next_path[j] = path[j]
            next_set[path[j]] = true
          end
          next_path[#next_path + 1] = block
          next_set[block] = true
          stack[#stack + 1] = {scored[i][3], scored[i][1], left - size[block], next_path, next_set}
        end
      end
    end
  end
  return best_path
end

-- The blocks not matched (core/online.py: _extension): the first by size * odds of retrieval, then each by
-- size * (holders that retrieved it + its share of retrievals) / (holders + 1), the holders being the requests
-- that retrieved every block placed so far; once there are none, the rest keep the relevance order.
local function copy_without(set, own)
  local out = {}
  for ordinal in pairs(set) do
    if ordinal ~= own then
      out[ordinal] = true
    end
  end
  return out
end

local function intersect(a, b)
  local out = {}
  for ordinal in pairs(a) do
    if b[ordinal] then
      out[ordinal] = true
    end
  end
  return out
end

local function extension(rest, size, path, own)
  local seen = math.max(1, seen_count)
  local unseen = seen_count + 1
  local count, first = {}, {}
  if #rest > 0 then
    local counts = redis.call('HMGET', KEYS[3], unpack(rest))
    local firsts = redis.call('HMGET', KEYS[4], unpack(rest))
    for i = 1, #rest do
      count[rest[i]] = tonumber(counts[i] or '0')
      first[rest[i]] = tonumber(firsts[i] or unseen)
    end
  end
  local holders = nil
  for i = 1, #path do
    local set = postings[path[i]] or {}
    holders = holders and intersect(holders, set) or copy_without(set, own)
  end
  local placed = {}
  while #rest > 0 do
    local holder_count = 0
    if holders ~= nil then
      for _ in pairs(holders) do
        holder_count = holder_count + 1
      end
      if holder_count == 0 then
        break  -- no earlier request holds every block placed: the rest keep the relevance order
      end
    end
    local best, best_value, best_first = nil, 0, 0
    for i = 1, #rest do
      local block = rest[i]
      local share = math.min(count[block] / seen, 0.999)
      local value
      if holders == nil then
        value = size[block] * share / (1.0 - share)
      else
        local n = 0
        local set = postings[block] or {}
        for ordinal in pairs(holders) do
          if set[ordinal] then
            n = n + 1
          end
        end
        value = size[block] * (n + share) / (holder_count + 1.0)
      end
      if best == nil or value > best_value or (value == best_value and first[block] < best_first) then
        best, best_value, best_first = i, value, first[block]
      end
    end
    local block = table.remove(rest, best)
    placed[#placed + 1] = block
    local set = postings[block] or {}
    holders = holders and intersect(holders, set) or copy_without(set, own)
  end
  for i = 1, #rest do
    placed[#placed + 1] = rest[i]
  end
  return placed
end

local function record(order)
  if #order == 0 or request_id == '' then
    return 0
  end
  evict(request_id)
  local clock = redis.call('HINCRBY', KEYS[3], '#clock', 1)
  refresh_now = refresh_now or clock == 1
  local node, ids = '', {}
  for i = 1, #order do
    node = child_id(node, order[i])
    ids[#ids + 1] = node
    redis.call('HINCRBY', KEYS[1], node, 1)
    redis.call('HSET', KEYS[1], node .. 't', clock)
  end
  redis.call('HSET', KEYS[5], request_id, table.concat(ids, ','))
  redis.call('RPUSH', KEYS[6], request_id)
  local forgotten = 0
  while redis.call('LLEN', KEYS[6]) > max_requests do
    local oldest = redis.call('LPOP', KEYS[6])
    local path = redis.call('HGET', KEYS[5], oldest)
    if path then
      redis.call('HDEL', KEYS[5], oldest)
      release(path)
      forgotten = forgotten + 1
    end
  end
  return forgotten
end

local function refresh()  -- every key gets the TTL again on one call in 64 (PEXPIRE costs a call per key)
  if ttl > 0 and (refresh_now or math.random(64) == 1) then
    for i = 1, 6 do
      redis.call('PEXPIRE', KEYS[i], ttl)
    end
  end
end

local result
if mode == 'evict' then
  result = 0
  for i = FIRST_ARG, #ARGV do
    result = result + evict(ARGV[i])
  end
elseif mode == 'record' then
  local order = {}
  for i = FIRST_ARG, #ARGV do
    order[#order + 1] = ARGV[i]
  end
  result = record(order)
else
  local blocks, size = {}, {}
  for i = FIRST_ARG, #ARGV - 1, 2 do
    blocks[#blocks + 1] = ARGV[i]
    size[ARGV[i]] = tonumber(ARGV[i + 1])
  end
  seen_count = observe(blocks)
  local clock = tonumber(redis.call('HGET', KEYS[3], '#clock') or '0')
  local path = match(blocks, size, clock)
  local placed = {}
  for i = 1, #path do
    placed[path[i]] = true
  end
  local rest = {}
  for i = 1, #blocks do
    if not placed[blocks[i]] then
      rest[#rest + 1] = blocks[i]
    end
  end
  local order = path
  for _, block in ipairs(extension(rest, size, path, seen_count)) do
    order[#order + 1] = block
  end
  if mode == 'both' then
    record(order)
  end
  result = order
end
refresh()
return result
