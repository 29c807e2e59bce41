-- decide.lua: a tenant's online order state (cpmemory/core/online.py, the same rules), shared by every worker.
-- KEYS[1] cnt   (hash)  trie node id -> requests recorded through it;  node id .. "t" -> clock of its last use
--                       (node id = 16 hex digits of sha1(parent id .. "|" .. block), the root is "")
-- KEYS[2] last  (unused, reserved)
-- KEYS[3] freq  (hash)  block -> retrieval count; "#seen" requests observed, "#clock" requests recorded
-- KEYS[4] first (hash)  block -> the "#seen" ordinal of the request that first retrieved it
-- KEYS[5] reqs  (hash)  request id -> the node ids of its recorded order, comma separated
-- KEYS[6] fifo  (list)  recorded request ids, oldest first (bounds the state)
-- (one tenant hash tag: every key in one cluster slot)
-- ARGV[1] mode: "order" (observe + order), "record", "both" (order + record), "evict"
-- ARGV[2] TTL of the state in ms (0 none)     ARGV[3] max recorded requests     ARGV[4] max blocks counted
-- ARGV[5] request id (record / both; "" none)  ARGV[6] match budget   ARGV[7] recency scale
-- ARGV[8 ..] order / both: block, size pairs (the request's distinct blocks, relevance order);
--            record: the blocks in the order sent;  evict: request ids
-- Returns the order (order / both), the number of ids forgotten (record), or the number evicted (evict).
-- Cost: the match expands at most ARGV[6] nodes (one HMGET pair each); record and evict are O(k).

local mode = ARGV[1]
local ttl = tonumber(ARGV[2])
local max_requests = tonumber(ARGV[3])
local max_blocks = tonumber(ARGV[4])
local request_id = ARGV[5]
local budget = tonumber(ARGV[6])
local scale = tonumber(ARGV[7])
local seen_count = 0
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
    redis.call('DEL', KEYS[3], KEYS[4])
  end
  local ordinal = redis.call('HINCRBY', KEYS[3], '#seen', 1)
  refresh_now = refresh_now or ordinal == 1
  for i = 1, #blocks do
    redis.call('HINCRBY', KEYS[3], blocks[i], 1)
    redis.call('HSETNX', KEYS[4], blocks[i], ordinal)
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

-- The blocks not matched, by size * odds of retrieval so far (core/online.py: _extension).
local function extension(rest, size)
  local seen = math.max(1, seen_count)
  local unseen = seen_count + 1
  local rank = {}
  if #rest > 0 then
    local counts = redis.call('HMGET', KEYS[3], unpack(rest))
    local firsts = redis.call('HMGET', KEYS[4], unpack(rest))
    for i = 1, #rest do
      local share = math.min(tonumber(counts[i] or '0') / seen, 0.999)
      rank[rest[i]] = {-size[rest[i]] * share / (1.0 - share), tonumber(firsts[i] or unseen), i}
    end
  end
  table.sort(rest, function(a, b)  -- Python's sort is stable: the request's own order breaks the last ties
    local x, y = rank[a], rank[b]
    if x[1] ~= y[1] then return x[1] < y[1] end
    if x[2] ~= y[2] then return x[2] < y[2] end
    return x[3] < y[3]
  end)
  return rest
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
  for i = 8, #ARGV do
    result = result + evict(ARGV[i])
  end
elseif mode == 'record' then
  local order = {}
  for i = 8, #ARGV do
    order[#order + 1] = ARGV[i]
  end
  result = record(order)
else
  local blocks, size = {}, {}
  for i = 8, #ARGV - 1, 2 do
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
  for _, block in ipairs(extension(rest, size)) do
    order[#order + 1] = block
  end
  if mode == 'both' then
    record(order)
  end
  result = order
end
refresh()
return result
