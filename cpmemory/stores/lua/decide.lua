-- decide.lua: a tenant's online order state (cpmemory/core/online.py), shared by every worker. The script keeps
-- the trie and the counts and runs observe and the match (the same rules as the Python orderer); the extension of
-- the order past the match runs in Python (cpmemory/stores/decisions.py: the orderer's own code) on the counts and
-- postings this script returns.
-- Blocks are 8-byte keys (cpmemory/stores/decisions.py: block_key); a trie node is an ENTRY (its 6-byte id,
-- requests recorded through it, clock of its last use) kept by its parent, in one of two shapes:
--   wide (the root, and a node with more than FANOUT children): one field per child, parent id .. block -> ENTRY
--        (the root's id is ''), and the parent's own field (its id) holds '' as the mark;
--   narrow: the parent's field (its id) holds its children as records, block .. ENTRY (24 bytes) each.
-- KEYS[1] trie  (hash)  the nodes, as above
-- KEYS[2] meta  (hash)  '#clock' requests recorded, '#n' last node id given, '#since' oldest clock trusted (nodes
--                       last used before it are ignored by the match: a gap), '#gap_ms' server time of the last gap
-- KEYS[3] freq  (hash)  block -> struct '>I6I6' (retrieval count, the '#seen' ordinal of the request that first
--                       retrieved it) then its posting: the ordinals of the last ARGV[10] requests that retrieved it
--                       ('>I4' each, modulo 2^32: a posting is only compared for equality; oldest first);
--                       '#seen' requests observed
-- KEYS[4] reqs  (hash)  request id -> the blocks of its recorded order (8 bytes each)
-- KEYS[5] fifo  (zset)  recorded request id -> the clock of its record (the oldest is forgotten first)
-- (one tenant hash tag: every key in one cluster slot)
-- ARGV[1] mode: "order" (observe + match), "record", "evict"
-- ARGV[2] TTL of the state in ms (0 none)     ARGV[3] max recorded requests     ARGV[4] max blocks counted
-- ARGV[5] request id (record; "" none)  ARGV[6] match budget   ARGV[7] recency scale
-- ARGV[8] gap: "" none; "reset" distrust every node now (the engine's cache was cleared); N: a call of this
--         worker failed N ms ago (distrust every node now, unless a gap was taken since then, less GAP_SLACK_MS)
-- ARGV[9] FANOUT: the most children a narrow node holds   ARGV[10] requests kept per block posting
-- ARGV[11 ..] order: the request's distinct blocks in relevance order (concatenated), their sizes (struct
--            '>d' each) and ranks (struct '>I4' each: the place of the caller's key among the request's keys in
--            string order, the match's tie-break; both unread, and may be empty, with a match budget of 0: a
--            later turn, observed only);  record: the blocks in the order sent (concatenated);  evict: request ids
-- Returns, for order: {the request's ordinal, the matched path (blocks concatenated), then each block's freq value
-- after observe (relevance order)}; for record the number of ids forgotten; for evict the number evicted.
-- Cost: the match expands at most ARGV[6] nodes: a narrow one is one HGET and a plain string.find per request
-- block, a wide one one HMGET; observe (counts and postings) is 4 calls; record and evict read and write one
-- field per block.
-- Why this layout: on a large hash every field read is a cache miss (about 2 us on the development machine),
-- and every redis.call, number formatted or parsed, string built and Lua-side comparison costs about a
-- microsecond, so a node's children sit in one field, numbers cross as binary structs, and sorts compare numbers.

-- A global is a table lookup on every use (and a library function two): the hot ones are read once, as locals.
local call, sub, find, spack, sunpack = redis.call, string.sub, string.find, struct.pack, struct.unpack

local mode = ARGV[1]
local ttl = tonumber(ARGV[2])
local max_requests = tonumber(ARGV[3])
local max_blocks = tonumber(ARGV[4])
local request_id = ARGV[5]
local budget = tonumber(ARGV[6])
local scale = tonumber(ARGV[7])
local gap = ARGV[8]
local FANOUT = tonumber(ARGV[9])
local posting_length = tonumber(ARGV[10])
local FIRST_BLOCK = 11
local ENTRY = '>I6I4I6'
local COUNTS = '>I6I6'
local RECORD = 24  -- a child in a narrow node: block (8 bytes) .. ENTRY (16 bytes)
local GAP_SLACK_MS = 2000
local CHUNK = 1000  -- Lua's unpack takes at most a few thousand values
local refresh_now = false

local clock, since = 0, 0  -- requests recorded, oldest clock trusted: unread when the call only observes
if mode ~= 'order' or budget > 0 or gap ~= '' then
  local meta = call('HMGET', KEYS[2], '#clock', '#since')
  clock, since = tonumber(meta[1] or '0'), tonumber(meta[2] or '0')
end

local function hmget(key, fields)
  if #fields <= CHUNK then
    return call('HMGET', key, unpack(fields))
  end
  local values = {}
  for start = 1, #fields, CHUNK do
    local part = call('HMGET', key, unpack(fields, start, math.min(start + CHUNK - 1, #fields)))
    for i = 1, #part do
      values[#values + 1] = part[i]
    end
  end
  return values
end

local function server_ms()
  local t = call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A gap: every node used so far is no longer trusted (the engine's cache moved on while nothing was recorded).
local function distrust(now)
  since = clock + 1
  call('HSET', KEYS[2], '#since', since, '#gap_ms', now)
end

-- Indices 1..n sorted by (primary ascending, secondary ascending); secondary values are distinct numbers.
-- A few indices (most nodes have 1-8 children among the request's blocks): an insertion sort with the comparisons
-- inline (no tables built; ~10% of the match's server time on the bench's first turns). More: only numbers are
-- sorted (table.sort's own comparison: a Lua comparator costs far more per call): each index becomes the exact
-- integer (dense rank of its primary) * (n + 1) + (rank of its secondary).
local function dense_ranks(values, n)  -- value -> its rank among the distinct values (1 = smallest)
  local sorted = {}
  for i = 1, n do
    sorted[i] = values[i]
  end
  table.sort(sorted)
  local rank_of, rank = {}, 0
  for i = 1, n do
    local value = sorted[i]
    if rank_of[value] == nil then
      rank = rank + 1
      rank_of[value] = rank
    end
  end
  return rank_of
end

local function sorted_by(primary, secondary, n)
  if n < 2 then
    return n == 1 and {1} or {}
  end
  if n <= 8 then  -- a few children (the common case): an insertion sort, comparisons inline
    local order = {}
    for i = 1, n do
      local value, tie, j = primary[i], secondary[i], i - 1
      while j > 0 and (primary[order[j]] > value or (primary[order[j]] == value and secondary[order[j]] > tie)) do
        order[j + 1] = order[j]
        j = j - 1
      end
      order[j + 1] = i
    end
    return order
  end
  local first_rank, second_rank = dense_ranks(primary, n), dense_ranks(secondary, n)
  local keys, index_of = {}, {}
  for i = 1, n do
    local key = first_rank[primary[i]] * (n + 1) + second_rank[secondary[i]]
    keys[i] = key
    index_of[key] = i
  end
  table.sort(keys)
  for i = 1, n do
    keys[i] = index_of[keys[i]]
  end
  return keys
end

-- The n values of struct `kind` ('d', 'I4') packed in `packed`, in chunks (a C call returns them on the stack).
local function unpack_all(kind, packed, n)
  local out, position, width = {}, 1, struct.size('>' .. kind)
  for start = 1, n, CHUNK do
    local count = math.min(CHUNK, n - start + 1)
    local part = {sunpack('>' .. string.rep(kind, count), packed, position)}
    for i = 1, count do
      out[start + i - 1] = part[i]
    end
    position = position + count * width
  end
  return out
end

local function split_blocks(packed)
  local blocks = {}
  for start = 1, #packed, 8 do
    blocks[#blocks + 1] = sub(packed, start, start + 7)
  end
  return blocks
end

-- ---------------------------------------------------------------- a node's children (see the layout above)
-- A container {parent id, records (nil: wide), changed}; writes are collected and flushed once per operation.
local sets, dels = {}, {}

local function open(parent)
  if parent == '' then
    return {parent, nil, false}
  end
  local records = call('HGET', KEYS[1], parent)
  if records == '' then
    return {parent, nil, false}
  end
  return {parent, records or '', false}
end

local function position(records, block)  -- where block's record starts in records, or nil
  local start = 1
  while true do
    local at = find(records, block, start, true)
    if not at or (at - 1) % RECORD == 0 then
      return at
    end
    start = at + 1
  end
end

local function child(container, block)  -- the child's ENTRY, or nil
  local records = container[2]
  if records == nil then
    return call('HGET', KEYS[1], container[1] .. block) or nil
  end
  local at = position(records, block)
  return at and sub(records, at + 8, at + RECORD - 1)
end

local function put(container, block, entry)  -- entry nil: the child goes
  local records = container[2]
  if records == nil then
    if entry then
      sets[#sets + 1] = container[1] .. block
      sets[#sets + 1] = entry
    else
      dels[#dels + 1] = container[1] .. block
    end
    return
  end
  local at = position(records, block)
  if at and entry then
    records = sub(records, 1, at + 7) .. entry .. sub(records, at + RECORD)
  elseif at then
    records = sub(records, 1, at - 1) .. sub(records, at + RECORD)
  elseif entry then
    records = records .. block .. entry
  end
  container[2], container[3] = records, true
end

local function close(container)  -- a narrow node's records written back; past FANOUT children it turns wide
  if not container[3] then
    return
  end
  local parent, records = container[1], container[2]
  if #records == 0 then
    dels[#dels + 1] = parent
  elseif #records > FANOUT * RECORD then
    for at = 1, #records, RECORD do
      sets[#sets + 1] = parent .. sub(records, at, at + 7)
      sets[#sets + 1] = sub(records, at + 8, at + RECORD - 1)
    end
    sets[#sets + 1] = parent
    sets[#sets + 1] = ''
  else
    sets[#sets + 1] = parent
    sets[#sets + 1] = records
  end
end

local function flush()  -- sets first: a node that went also loses the fields written for it
  for start = 1, #sets, 2 * CHUNK do
    call('HSET', KEYS[1], unpack(sets, start, math.min(start + 2 * CHUNK - 1, #sets)))
  end
  for start = 1, #dels, CHUNK do
    call('HDEL', KEYS[1], unpack(dels, start, math.min(start + CHUNK - 1, #dels)))
  end
  sets, dels = {}, {}
end

-- Take one recorded order (its blocks, concatenated) off the trie: counts down, nodes no request holds go.
local function release(path)
  local parent = ''
  for start = 1, #path, 8 do
    local block = sub(path, start, start + 7)
    local container = open(parent)
    local entry = child(container, block)
    if not entry then
      break
    end
    local id, count, last = sunpack(ENTRY, entry)
    parent = sub(entry, 1, 6)
    if count <= 1 then
      put(container, block, nil)
      dels[#dels + 1] = parent  -- its own children field (records or the wide mark) goes with it
    else
      put(container, block, spack(ENTRY, id, count - 1, last))
    end
    close(container)
  end
  flush()
end

local function evict(id)
  local path = call('HGET', KEYS[4], id)
  if not path then
    return 0
  end
  call('HDEL', KEYS[4], id)
  call('ZREM', KEYS[5], id)
  release(path)
  return 1
end

-- Count the request's blocks and add the request to their postings (core/online.py: observe). Returns the
-- request's ordinal and each block's value after it (struct COUNTS, then the posting).
local function observe(blocks)
  if call('HLEN', KEYS[3]) > max_blocks then  -- bounded: forget the popularity learnt so far
    call('DEL', KEYS[3])
  end
  local ordinal = call('HINCRBY', KEYS[3], '#seen', 1)
  refresh_now = refresh_now or ordinal == 1
  local values = hmget(KEYS[3], blocks)
  local out, pairs = {}, {}
  local own = spack('>I4', ordinal % 4294967296)
  for i = 1, #blocks do
    local count, first, posting = 0, ordinal, ''
    local value = values[i]
    if value then
      count, first = sunpack(COUNTS, value)
      posting = sub(value, 13)
      if #posting >= 4 * posting_length then
        posting = sub(posting, #posting - 4 * (posting_length - 1) + 1)
      end
    end
    out[i] = spack(COUNTS, count + 1, first) .. posting .. own
    pairs[2 * i - 1] = blocks[i]
    pairs[2 * i] = out[i]
  end
  for start = 1, #pairs, 2 * CHUNK do
    call('HSET', KEYS[3], unpack(pairs, start, math.min(start + 2 * CHUNK - 1, #pairs)))
  end
  return ordinal, out
end

-- The children of the node `parent` among the request's blocks not on its path (block i is on the path of the
-- node at `depth` when path_at[depth_of[i]] == i with depth_of[i] <= depth): their entries and block indices
-- into `entries` / `indices` (reused); returns how many.
local function children_among(parent, blocks, index_of, path, entries, indices)
  local depth_of, path_at, depth = path[1], path[2], path[3]
  local records = ''  -- the root is wide
  if parent ~= '' then
    records = call('HGET', KEYS[1], parent)  -- false: no children
  end
  local found = 0
  if records == '' then  -- wide (the root, or the mark): one field per child
    local fields, candidates = {}, {}
    for i = 1, #blocks do
      local at = depth_of[i]
      if at == nil or at > depth or path_at[at] ~= i then
        candidates[#candidates + 1] = i
        fields[#fields + 1] = parent .. blocks[i]
      end
    end
    if #fields > 0 then
      local values = hmget(KEYS[1], fields)
      for j = 1, #candidates do
        if values[j] then
          found = found + 1
          entries[found], indices[found] = values[j], candidates[j]
        end
      end
    end
  elseif records and #records < RECORD * #blocks then  -- fewer children than blocks: read each child
    for at = 1, #records, RECORD do
      local i = index_of[sub(records, at, at + 7)]
      local placed = i and depth_of[i]
      if i and (placed == nil or placed > depth or path_at[placed] ~= i) then
        found = found + 1
        entries[found], indices[found] = sub(records, at + 8, at + RECORD - 1), i
      end
    end
  elseif records then  -- else look each block up (a plain find, in C)
    for i = 1, #blocks do
      local at = depth_of[i]
      if at == nil or at > depth or path_at[at] ~= i then
        local at = position(records, blocks[i])
        if at then
          found = found + 1
          entries[found], indices[found] = sub(records, at + 8, at + RECORD - 1), i
        end
      end
    end
  end
  return found
end

-- Branch and bound over the recorded paths restricted to the request's blocks (core/online.py: match).
-- Returns the indices (into blocks) of the best path. A stack entry: {node id, score, size left, block index,
-- parent entry}; the blocks on an entry's path are found by walking its parents (at most `budget` times).
local function match(blocks, size, rank)
  local total = 0
  for i = 1, #blocks do
    total = total + size[i]
  end
  local best_score, best = 0, nil
  local stack, top = {{'', 0, total, 0, nil, 0}}, 1  -- node id, score, size left, block, parent entry, depth
  local depth_of, path_at = {}, {}
  local path = {depth_of, path_at, 0}
  local entries, indices, scores, ranks, ids = {}, {}, {}, {}, {}
  local index_of = {}
  for i = 1, #blocks do
    index_of[blocks[i]] = i
  end
  while top > 0 and budget > 0 do
    local entry = stack[top]
    stack[top] = nil
    top = top - 1
    local node, score, left = entry[1], entry[2], entry[3]
    if score + left > best_score then
      budget = budget - 1
      if score > best_score then
        best_score, best = score, entry
      end
      local depth = entry[6]
      if depth > 0 then  -- the stack is depth first: the path above this node is path_at[1 .. depth - 1]
        path_at[depth], depth_of[entry[4]] = entry[4], depth
      end
      path[3] = depth
      local kept = 0
      for j = 1, children_among(node, blocks, index_of, path, entries, indices) do
        local last = sunpack('>I6', entries[j], 11)  -- ENTRY's last use
        if last >= since then
          local i = indices[j]
          kept = kept + 1
          scores[kept] = score + size[i] / (1.0 + (clock - last) / scale)
          ranks[kept], ids[kept] = rank[i], j
        end
      end
      for _, k in ipairs(sorted_by(scores, ranks, kept)) do  -- ascending: the best child is popped first
        local j = ids[k]
        local i = indices[j]
        top = top + 1
        stack[top] = {sub(entries[j], 1, 6), scores[k], left - size[i], i, entry, depth + 1}
      end
    end
  end
  local path = {}
  while best ~= nil and best[4] > 0 do
    table.insert(path, 1, best[4])
    best = best[5]
  end
  return path
end

local function record(order)
  if #order == 0 or request_id == '' then
    return 0
  end
  evict(request_id)
  clock = clock + 1
  refresh_now = refresh_now or clock == 1
  local parent, next_id, last_id = '', 0, -1
  for depth = 1, #order do
    local block = order[depth]
    local container, entry
    if next_id <= last_id then  -- below a new node: nothing yet
      container = {parent, '', false}
    else
      container = open(parent)
      entry = child(container, block)
    end
    local id, count = 0, 0
    if entry then
      id, count = sunpack(ENTRY, entry)
    else
      if next_id > last_id then  -- this node and every one below it are new: their ids at once
        last_id = call('HINCRBY', KEYS[2], '#n', #order - depth + 1)
        next_id = last_id - (#order - depth)
      end
      id, next_id = next_id, next_id + 1
    end
    entry = spack(ENTRY, id, count + 1, clock)
    put(container, block, entry)
    close(container)
    parent = sub(entry, 1, 6)
  end
  flush()
  call('HSET', KEYS[2], '#clock', clock)
  call('HSET', KEYS[4], request_id, table.concat(order))
  call('ZADD', KEYS[5], clock, request_id)
  local forgotten = 0
  while call('ZCARD', KEYS[5]) > max_requests do
    forgotten = forgotten + evict(call('ZRANGE', KEYS[5], 0, 0)[1])
  end
  return forgotten
end

local function refresh()  -- every key gets the TTL again on one call in 64 (PEXPIRE costs a call per key)
  if ttl > 0 and (refresh_now or math.random(64) == 1) then
    for i = 1, 5 do
      call('PEXPIRE', KEYS[i], ttl)
    end
  end
end

if gap == 'reset' then
  distrust(server_ms())
elseif gap ~= '' then
  local now = server_ms()
  if tonumber(call('HGET', KEYS[2], '#gap_ms') or '-1') < now - tonumber(gap) - GAP_SLACK_MS then
    distrust(now)
  end
end

local result
if mode == 'evict' then
  result = 0
  for i = FIRST_BLOCK, #ARGV do
    result = result + evict(ARGV[i])
  end
elseif mode == 'record' then
  result = record(split_blocks(ARGV[FIRST_BLOCK]))
elseif mode == 'order' then
  local blocks = split_blocks(ARGV[FIRST_BLOCK])
  local own, values = observe(blocks)
  local path = {}
  if budget > 0 then  -- 0: a later turn, observed only (no recorded order is a prefix of its prompt)
    local size = unpack_all('d', ARGV[FIRST_BLOCK + 1], #blocks)
    local rank = unpack_all('I4', ARGV[FIRST_BLOCK + 2], #blocks)
    for _, i in ipairs(match(blocks, size, rank)) do
      path[#path + 1] = blocks[i]
    end
  end
  result = {own, table.concat(path)}
  for i = 1, #values do
    result[i + 2] = values[i]
  end
else
  return redis.error_reply('decide.lua: unknown mode ' .. tostring(mode))
end
refresh()
return result
