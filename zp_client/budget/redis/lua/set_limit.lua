-- set_limit.lua: change the limit by compare-and-set (Ledger.set_limit). Never revokes a lease: when
-- used exceeds the new limit, admission pauses. Waiters larger than the new limit are failed (their
-- mailbox gets '!id'; larger than the size limit, see keep_size): the first 256 of the line here, the rest when a grant pass or their
-- own process's poll meets them (bounded work per call).
-- ARGV: new limit, expected current limit ('' = unconditional), fence (optional: an adaptive
-- controller's id; the change applies only while that id holds the leader lease, adaptive.lua),
-- keep_size (optional: '1' keeps the size limit, see below)
-- Returns {'I'} budget absent | {1, limit, version} applied | {0, current limit, version} CAS failed |
-- {0, current limit, version, 'L'} the fence's holder is not the leader (nothing changed).
if redis.call('EXISTS', K_META) == 0 then return {'I'} end
local new = int_arg(ARGV[1], 'limit', 0, 1e12)
local cur = meta_num('limit')
if ARGV[3] and ARGV[3] ~= '' and redis.call('GET', PREFIX .. ':adaptive:leader') ~= ARGV[3] then
  return {0, cur, meta_num('ver'), 'L'}
end
if ARGV[2] ~= '' and tonumber(ARGV[2]) ~= cur then
  return {0, cur, meta_num('ver')}
end
-- keep_size (ARGV[4] = '1', a temporary cut): the size limit stays at least what it was, so waiters
-- and new requests up to it wait for the limit to come back; otherwise it follows the new limit.
if ARGV[4] == '1' then
  redis.call('HSET', K_META, 'slimit', math.max(size_limit(cur), new))
else
  redis.call('HDEL', K_META, 'slimit')
end
redis.call('HSET', K_META, 'limit', new)
local ver = redis.call('HINCRBY', K_META, 'ver', 1)
local slimit = size_limit(new)
local boxes = {}
for _, m in ipairs(redis.call('ZRANGE', K_LINE, 0, 255)) do
  local id = string.sub(m, 14)
  local raw = redis.call('HGET', K_WAIT, id)
  if raw then reject_if_too_large(id, cjson.decode(raw), slimit, boxes) end
end
notify(boxes)
local now = now_ms()
reap(now)
grant(now, '')
return {1, new, ver}
