-- snapshot.lua: a read-only, bounded copy of the budget's state, for the client's wait prediction
-- (zp_client/budget/redis/_snapshot.py turns it into a Ledger and replays it, zp_client/budget/predict.py;
-- docs/admission.md#predicted-wait-and-fail-fast). Writes nothing: expired leases and waiters not reaped
-- yet are in it (a waiter whose heartbeat lapsed comes with its expiry, the client leaves it out).
-- ARGV: cap (the most live leases, and the most waiters, it copies: 1..100000)
-- Returns {'A'} the budget is absent | {'F'} a fleet, or prefixes are pinned (not predicted)
--       | {'C', leases, waiters} more than cap of either (not copied)
--       | {'S', now_ms, {limit, bs, policy, starve, lpt, line, lb, rec, slimit, rz, rk, ru},
--          {lease id, record, ...} (HGETALL), {waiter id, record, heartbeat expiry ms, ...} in line order}
if redis.call('EXISTS', K_META) == 0 then return {'A'} end
local cap = int_arg(ARGV[1], 'cap', 1, 100000)
if redis.call('HGET', K_META, 'fleet') == '1' or redis.call('EXISTS', K_PINS) == 1 then return {'F'} end
local nl = redis.call('HLEN', K_LEASES)
local nw = redis.call('ZCARD', K_LINE)
if nl > cap or nw > cap then return {'C', nl, nw} end
local now = now_ms()
local meta = redis.call('HMGET', K_META, 'limit', 'bs', 'policy', 'starve', 'lpt', 'line', 'lb', 'rec', 'slimit',
  'rz', 'rk', 'ru')
for i = 1, 12 do meta[i] = meta[i] or '' end
local ws = {}
for _, member in ipairs(redis.call('ZRANGE', K_LINE, 0, -1)) do
  local id = string.sub(member, 14)
  ws[#ws + 1] = id
  ws[#ws + 1] = redis.call('HGET', K_WAIT, id) or ''
  ws[#ws + 1] = redis.call('ZSCORE', K_WEXP, id) or ''
end
return {'S', now, meta, redis.call('HGETALL', K_LEASES), ws}
