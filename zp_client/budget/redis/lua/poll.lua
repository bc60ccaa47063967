-- poll.lua: the bounded-poll fallback and waiter heartbeat for one process's waiters. Refreshes each
-- waiter's heartbeat (dead processes' waiters expire and leave the line), reaps expired leases, runs a
-- grant pass, and reports each waiter's state, so a lost wake-up costs at most one poll interval.
-- ARGV: waiter_ttl_ms, owner (the polling process: heard; '' none), ids...
-- Returns {'I'} budget absent | {recovery_left_ms, state...}: 'G' granted ('G@<replica id>' in fleet
-- mode; the grant is claimed by this call: the process learns of it from this reply), 'W' waiting, 'N' unknown
-- (reaped, rejected by a lowered limit, or lost with Redis' state: the caller enqueues again).
if redis.call('EXISTS', K_META) == 0 then return {'I'} end
local wttl = int_arg(ARGV[1], 'waiter_ttl_ms', 1, 1e9)
local now = now_ms()
heard(ARGV[2], now)
reap(now)
-- Batched commands (a constant number per chunk of ids, not several per waiter): idle waiters cost
-- Redis little even when a process has hundreds of them.
local CHUNK = 500
local slimit = size_limit(meta_num('limit'))
local boxes = {}
for c = 3, #ARGV, CHUNK do
  local ids, zargs = {}, {}
  for i = c, math.min(#ARGV, c + CHUNK - 1) do
    table.insert(ids, ARGV[i])
    table.insert(zargs, now + wttl)
    table.insert(zargs, ARGV[i])
  end
  redis.call('ZADD', K_WEXP, 'XX', unpack(zargs))
  local raws = redis.call('HMGET', K_WAIT, unpack(ids))
  for j, raw in ipairs(raws) do
    if raw then reject_if_too_large(ids[j], cjson.decode(raw), slimit, boxes) end
  end
end
notify(boxes)
grant(now, '')
local out = {math.max(0, meta_num('rec') - now)}
for c = 3, #ARGV, CHUNK do
  local ids = {}
  for i = c, math.min(#ARGV, c + CHUNK - 1) do table.insert(ids, ARGV[i]) end
  local ws = redis.call('HMGET', K_WAIT, unpack(ids))
  local ls = redis.call('HMGET', K_LEASES, unpack(ids))
  for j = 1, #ids do
    if ls[j] then
      local l = cjson.decode(ls[j])
      claim_lease(ids[j], l, now)
      local r = l.r
      if r then table.insert(out, 'G@' .. r) else table.insert(out, 'G') end
    elseif ws[j] then table.insert(out, 'W')
    else table.insert(out, 'N') end
  end
end
return out
