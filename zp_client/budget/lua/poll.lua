-- poll.lua: the bounded-poll fallback and waiter heartbeat for one process's waiters. Refreshes each
-- waiter's heartbeat (dead processes' waiters expire and leave the line), reaps expired leases, runs a
-- grant pass, and reports each waiter's state, so a lost wake-up costs at most one poll interval.
-- ARGV: waiter_ttl_ms, ids...
-- Returns {'I'} budget absent | {recovery_left_ms, state...}: 'G' granted, 'W' waiting, 'N' unknown
-- (reaped, rejected by a lowered limit, or lost with Redis' state: the caller enqueues again).
if redis.call('EXISTS', K_META) == 0 then return {'I'} end
local wttl = int_arg(ARGV[1], 'waiter_ttl_ms', 1, 1e9)
local now = now_ms()
reap(now)
for i = 2, #ARGV do
  redis.call('ZADD', K_WEXP, 'XX', now + wttl, ARGV[i])
end
local limit = meta_num('limit')
local boxes = {}
for i = 2, #ARGV do
  local raw = redis.call('HGET', K_WAIT, ARGV[i])
  if raw then reject_if_too_large(ARGV[i], cjson.decode(raw), limit, boxes) end
end
notify(boxes)
grant(now, '')
local out = {math.max(0, meta_num('rec') - now)}
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('HEXISTS', K_LEASES, id) == 1 then table.insert(out, 'G')
  elseif redis.call('HEXISTS', K_WAIT, id) == 1 then table.insert(out, 'W')
  else table.insert(out, 'N') end
end
return out
