"""The Redis queue's Lua scripts (gateway/queue/redis.py registers them): each step that must be atomic
(put, pull, publish, renew, release, reap, expire, cancel, depth) is one script, so no other client sees
a request half moved between the queue, the lease set and its result stream. All times come from
Redis's `TIME`, so the machines' clocks never have to agree. Each script reads its keys from the prefix
in ARGV[1]; the key layout is in redis.py's docstring."""

_NOW = """
local _t = redis.call('TIME')
local now = tonumber(_t[1]) + tonumber(_t[2]) / 1000000
"""

# Back into the queue at the original place, with the published tokens as `resume`.
# required_owner: '' = whoever holds it (the reaper), else only that owner's (a hand-back).
_REQUEUE = """
local function requeue(p, id, required_owner)
  local ik = p .. ':item:' .. id
  if redis.call('EXISTS', ik) == 0 then
    redis.call('ZREM', p .. ':leased', id)
    return 0
  end
  local owner = redis.call('HGET', ik, 'owner') or ''
  if owner == '' then
    redis.call('ZREM', p .. ':leased', id)
    return 0
  end
  if required_owner ~= '' and owner ~= required_owner then return 0 end
  local toks = {}
  for _, e in ipairs(redis.call('XRANGE', p .. ':res:' .. id, '-', '+')) do
    local f = e[2]
    for i = 1, #f, 2 do
      if f[i] == 'tok' and f[i + 1] ~= '' then toks[#toks + 1] = f[i + 1] end
    end
  end
  redis.call('HSET', ik, 'owner', '', 'resume', table.concat(toks, ','))
  redis.call('HINCRBY', ik, 'attempt', 1)
  redis.call('ZREM', p .. ':leased', id)
  local prio = redis.call('HGET', ik, 'prio')
  redis.call('ZADD', p .. ':q:' .. prio, tonumber(redis.call('HGET', ik, 'seq')), id)
  redis.call('SADD', p .. ':prios', prio)
  redis.call('HINCRBY', p .. ':depth', redis.call('HGET', ik, 'tier'), 1)
  redis.call('LPUSH', p .. ':wake', '1')
  redis.call('LTRIM', p .. ':wake', 0, 1023)
  return 1
end
"""

# Fair share between keys of one priority (queue/fair.py's start-time tags): {p}:vt is each priority's
# virtual time, {p}:fin:{prio} each key's last finish tag. A queued item's score (its `seq`) is its start
# tag; its key and cost are kept so a request that leaves unserved gives its share back (`withdraw`).
_WITHDRAW = """
local function withdraw(p, ik, prio)
  local g = redis.call('HMGET', ik, 'seq', 'fkey', 'cost')
  if not g[1] or not g[2] or not g[3] then return end
  local fk = p .. ':fin:' .. prio
  local start = tonumber(g[1])
  if tonumber(redis.call('HGET', fk, g[2]) or '-1') == start + tonumber(g[3]) then
    redis.call('HSET', fk, g[2], string.format('%.17g', start))
  end
end
"""

# ARGV: prefix, id, data, tier, prio, age_s, deadline_in_s ('' = none), limit, fair key ('' = none), cost
PUT = _NOW + """
local p, id, tier, prio = ARGV[1], ARGV[2], ARGV[4], ARGV[5]
local depth = tonumber(redis.call('HGET', p .. ':depth', tier) or '0')
if depth >= tonumber(ARGV[8]) then return {0, depth} end
local ik = p .. ':item:' .. id
if redis.call('EXISTS', ik) == 1 then return {-1, depth} end
local fkey, cost = ARGV[9] or '', math.max(tonumber(ARGV[10] or '1') or 1, 1e-9)
local fk = p .. ':fin:' .. prio
local vt = tonumber(redis.call('HGET', p .. ':vt', prio) or '0')
local start = math.max(vt, tonumber(redis.call('HGET', fk, fkey) or '0'))
redis.call('HSET', fk, fkey, string.format('%.17g', start + cost))
local seq = string.format('%.17g', start)
redis.call('HSET', ik, 'data', ARGV[3], 'tier', tier, 'prio', prio, 'seq', seq, 'fkey', fkey,
           'cost', string.format('%.17g', cost),
           'enq', tostring(now - tonumber(ARGV[6])), 'owner', '', 'attempt', 0, 'resume', '', 'last_seq', -1)
if ARGV[7] ~= '' then
  local dl = now + tonumber(ARGV[7])
  redis.call('HSET', ik, 'deadline', tostring(dl))
  redis.call('ZADD', p .. ':deadlines', dl, id)
end
redis.call('ZADD', p .. ':q:' .. prio, start, id)
redis.call('SADD', p .. ':prios', prio)
redis.call('HINCRBY', p .. ':depth', tier, 1)
redis.call('LPUSH', p .. ':wake', '1')
redis.call('LTRIM', p .. ':wake', 0, 1023)
return {1, depth + 1}
"""

# ARGV: prefix, worker, max_items, need, lease_s, aging_s
# Returns {now, total_before, id1, data1, resume1, enq1, deadline1, ...} (items only when total >= need).
PULL = _NOW + """
local p, worker = ARGV[1], ARGV[2]
local max_items, need = tonumber(ARGV[3]), tonumber(ARGV[4])
local lease, aging = tonumber(ARGV[5]), tonumber(ARGV[6])
local prios = redis.call('SMEMBERS', p .. ':prios')
local lists, pos, total = {}, {}, 0
for _, pr in ipairs(prios) do
  local c = redis.call('ZCARD', p .. ':q:' .. pr)
  if c == 0 then
    redis.call('SREM', p .. ':prios', pr)
  else
    total = total + c
    lists[pr] = redis.call('ZRANGE', p .. ':q:' .. pr, 0, max_items - 1)
    pos[pr] = 1
  end
end
if total == 0 then redis.call('DEL', p .. ':wake') end
if total == 0 or total < need then return {tostring(now), total} end
local enq = {}
local function enq_of(id)
  if enq[id] == nil then enq[id] = tonumber(redis.call('HGET', p .. ':item:' .. id, 'enq') or now) end
  return enq[id]
end
local picked = {}
while #picked < max_items do
  local best, best_pr, best_aged, best_enq = nil, nil, false, 0
  for pr, list in pairs(lists) do
    local id = list[pos[pr]]
    if id then
      local e = enq_of(id)
      local aged = (now - e) >= aging
      if aged then
        if (not best_aged) or e < best_enq then best, best_pr, best_aged, best_enq = id, pr, true, e end
      elseif (not best_aged) and (best == nil or tonumber(pr) < tonumber(best_pr)) then
        best, best_pr, best_enq = id, pr, e
      end
    end
  end
  if best == nil then break end
  pos[best_pr] = pos[best_pr] + 1
  picked[#picked + 1] = {best, best_pr}
end
local out = {tostring(now), total}
for _, pi in ipairs(picked) do
  local id, pr = pi[1], pi[2]
  local ik = p .. ':item:' .. id
  local tag = tonumber(redis.call('ZSCORE', p .. ':q:' .. pr, id) or '0')
  if tag > tonumber(redis.call('HGET', p .. ':vt', pr) or '0') then
    redis.call('HSET', p .. ':vt', pr, string.format('%.17g', tag))
  end
  redis.call('ZREM', p .. ':q:' .. pr, id)
  redis.call('ZREM', p .. ':deadlines', id)
  local f = redis.call('HMGET', ik, 'data', 'resume', 'enq', 'deadline', 'tier')
  redis.call('HSET', ik, 'owner', worker)
  redis.call('ZADD', p .. ':leased', now + lease, id)
  redis.call('HINCRBY', p .. ':depth', f[5], -1)
  out[#out + 1] = id
  out[#out + 1] = f[1]
  out[#out + 1] = f[2] or ''
  out[#out + 1] = f[3] or ''
  out[#out + 1] = f[4] or ''
end
if total - #picked == 0 then redis.call('DEL', p .. ':wake') end
for _, pi in ipairs(picked) do  -- keys whose finish is behind the clock count as new: forget them
  local fk = p .. ':fin:' .. pi[2]
  if redis.call('HLEN', fk) > 1024 then
    local vt = tonumber(redis.call('HGET', p .. ':vt', pi[2]) or '0')
    local all = redis.call('HGETALL', fk)
    for i = 1, #all, 2 do
      if tonumber(all[i + 1]) <= vt then redis.call('HDEL', fk, all[i]) end
    end
  end
end
return out
"""

# ARGV: prefix, worker ('' = unfenced), ttl_s, final_ttl_s, then 5 per output: id, seq, fin, tok, data.
# Returns the ids this worker no longer owns (cancelled, or reclaimed after its lease expired).
PUBLISH = """
local p, worker, ttl, final_ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local lost = {}
for i = 5, #ARGV, 5 do
  local id, seq, fin, tok, data = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local ik = p .. ':item:' .. id
  local owner = redis.call('HGET', ik, 'owner')
  if worker ~= '' and owner ~= worker then
    lost[#lost + 1] = id
  else
    local rk = p .. ':res:' .. id
    local last = tonumber(owner and redis.call('HGET', ik, 'last_seq') or -1) or -1
    if seq > last or seq <= 0 or fin == '1' then
      redis.call('XADD', rk, '*', 'seq', seq, 'fin', fin, 'tok', tok, 'data', data)
      if owner then redis.call('HSET', ik, 'last_seq', seq) end
    end
    if fin == '1' then
      redis.call('EXPIRE', rk, final_ttl)
      redis.call('DEL', ik)
      redis.call('ZREM', p .. ':leased', id)
    else
      redis.call('EXPIRE', rk, ttl)
    end
  end
end
return lost
"""

# ARGV: prefix, worker, lease_s, ids...  -> ids no longer owned
RENEW = _NOW + """
local p, worker, lease = ARGV[1], ARGV[2], tonumber(ARGV[3])
local lost = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  if redis.call('HGET', p .. ':item:' .. id, 'owner') == worker then
    redis.call('ZADD', p .. ':leased', now + lease, id)
  else
    lost[#lost + 1] = id
  end
end
return lost
"""

# ARGV: prefix, worker, ids... -> number handed back
RELEASE = _REQUEUE + """
local n = 0
for i = 3, #ARGV do n = n + requeue(ARGV[1], ARGV[i], ARGV[2]) end
return n
"""

_EXPIRE_FN = _WITHDRAW + """
local function expire(p, id, final_ttl)
  redis.call('ZREM', p .. ':deadlines', id)
  local ik = p .. ':item:' .. id
  local f = redis.call('HMGET', ik, 'owner', 'prio', 'tier')
  if f[1] == '' and redis.call('ZREM', p .. ':q:' .. f[2], id) == 1 then
    redis.call('HINCRBY', p .. ':depth', f[3], -1)
    withdraw(p, ik, f[2])
    redis.call('DEL', ik)
    local rk = p .. ':res:' .. id
    redis.call('XADD', rk, '*', 'seq', 0, 'fin', '1', 'tok', '', 'err', 'queue_timeout')
    redis.call('EXPIRE', rk, final_ttl)
    return 1
  end
  return 0
end
"""

# ARGV: prefix, limit, final_ttl_s -> {reclaimed, expired}
REAP = _NOW + _REQUEUE + _EXPIRE_FN + """
local p, limit, final_ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local reclaimed, expired = 0, 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', p .. ':leased', '-inf', now, 'LIMIT', 0, limit)) do
  reclaimed = reclaimed + requeue(p, id, '')
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', p .. ':deadlines', '-inf', now, 'LIMIT', 0, limit)) do
  expired = expired + expire(p, id, final_ttl)
end
return {reclaimed, expired}
"""

# ARGV: prefix, id, final_ttl_s -> 1 when the item was still queued (now dropped with a queue_timeout result)
EXPIRE = _EXPIRE_FN + """
return expire(ARGV[1], ARGV[2], tonumber(ARGV[3]))
"""

# ARGV: prefix, id -> 'queued' | 'running' | 'unknown'
CANCEL = _WITHDRAW + """
local p, id = ARGV[1], ARGV[2]
local ik = p .. ':item:' .. id
local f = redis.call('HMGET', ik, 'owner', 'prio', 'tier')
if f[1] == '' then
  if redis.call('ZREM', p .. ':q:' .. f[2], id) == 1 then
    redis.call('HINCRBY', p .. ':depth', f[3], -1)
    withdraw(p, ik, f[2])
  end
  redis.call('ZREM', p .. ':deadlines', id)
  redis.call('DEL', ik)
  return 'queued'
end
redis.call('DEL', ik)
redis.call('ZREM', p .. ':leased', id)
redis.call('PUBLISH', p .. ':cancel', id)
if f[1] then return 'running' end
return 'unknown'
"""

DEPTH = """
local p = ARGV[1]
if ARGV[2] ~= '' then return tonumber(redis.call('HGET', p .. ':depth', ARGV[2]) or '0') end
local n = 0
for _, pr in ipairs(redis.call('SMEMBERS', p .. ':prios')) do n = n + redis.call('ZCARD', p .. ':q:' .. pr) end
return n
"""
