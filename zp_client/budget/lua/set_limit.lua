-- set_limit.lua: change the limit by compare-and-set (Ledger.set_limit). Never revokes a lease: when
-- used exceeds the new limit, admission pauses. Waiters larger than the new limit are failed (their
-- mailbox gets '!id'); the grant pass does the same lazily for any it meets later (bounded work).
-- ARGV: new limit, expected current limit ('' = unconditional)
-- Returns {'I'} budget absent | {1, limit, version} applied | {0, current limit, version} CAS failed.
if redis.call('EXISTS', K_META) == 0 then return {'I'} end
local new = int_arg(ARGV[1], 'limit', 0, 1e12)
local cur = meta_num('limit')
if ARGV[2] ~= '' and tonumber(ARGV[2]) ~= cur then
  return {0, cur, meta_num('ver')}
end
redis.call('HSET', K_META, 'limit', new)
local ver = redis.call('HINCRBY', K_META, 'ver', 1)
local now = now_ms()
reap(now)
grant(now, '')
return {1, new, ver}
