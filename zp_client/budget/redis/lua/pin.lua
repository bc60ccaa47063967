-- pin.lua: pinned prefixes (Ledger.pin / unpin, PinBook.due / claim; common.lua's pins section).
-- ARGV[1] is the operation:
--   'pin', key, blocks, span, margin ('' = the default), track (1/0), owner, ttl_ms, cap (share of the
--          limit), pool ('' = keep; the server's usable pool)
--          -> {'P', blocks, mine} pinned (mine = 1: this owner holds the pin's lease, renewed now; 0:
--             another process pinned it first) | {'R', pinned blocks, cap} refused past the cap |
--             {'E', blocks} pinned already with another size | {'I'} budget absent
--   'unpin', key, owner -> 1 dropped | 0 not pinned by this owner
--   'due' -> the keys whose keep-warm is due and not claimed (sorted)
--   'claim', key, ttl_ms -> 1 claimed (this caller sends the keep-warm) | 0 not due or claimed already
if redis.call('EXISTS', K_META) == 0 then return {'I'} end
local op = ARGV[1]
local now = now_ms()
if op == 'pin' then heard(ARGV[7], now) elseif op == 'unpin' then heard(ARGV[3], now) end
reap(now)
if op == 'due' then
  local pins = p_load()
  if pins == nil then return {} end
  return p_due(pins, now)
end
local key = ARGV[2]
if type(key) ~= 'string' or key == '' or string.len(key) > 256 then
  error({err = 'ERR zp: a prefix key must be a string of 1..256 characters'})
end
local lid = 'pin:' .. key
if op == 'claim' then
  local ttl = int_arg(ARGV[3], 'ttl_ms', 1, 1e9)
  local pins = p_load()
  if pins == nil then return 0 end
  for _, k in ipairs(p_due(pins, now)) do
    if k == key then
      local p = pins[key]
      p.cu = now + ttl
      p.kw = (p.kw or 0) + 1
      p_save(key, p)
      return 1
    end
  end
  return 0
end
if op == 'unpin' then
  local raw = redis.call('HGET', K_LEASES, lid)
  if not raw or cjson.decode(raw).w ~= ARGV[3] then return 0 end
  drop_lease(lid, raw)
  grant(now, '')
  return 1
end
if op ~= 'pin' then error({err = 'ERR zp: unknown pin operation ' .. tostring(op)}) end
if redis.call('HGET', K_META, 'policy') ~= 'elastic' then
  error({err = "ERR zp: pinned prefixes need policy='elastic'"})
end
if redis.call('HGET', K_META, 'fleet') == '1' then
  error({err = 'ERR zp: a Redis fleet does not support pinned prefixes yet'})
end
local blocks = int_arg(ARGV[3], 'blocks', 1, 1e12)
local span = int_arg(ARGV[4], 'span', blocks, 1e12)
local owner = ARGV[7]
local ttl = int_arg(ARGV[8], 'lease_ttl_ms', 1, 1e9)
local capf = tonumber(ARGV[9])
if capf == nil or capf < 0 or capf > 1 then error({err = 'ERR zp: pin cap must be a share in [0, 1]'}) end
if ARGV[10] ~= nil and ARGV[10] ~= '' then
  redis.call('HSET', K_META, 'pool', int_arg(ARGV[10], 'server blocks', 1, 1e12))
end
local raw = redis.call('HGET', K_PINS, key)
if raw then
  local p = cjson.decode(raw)
  if p.b ~= blocks then return {'E', p.b} end
  local lraw = redis.call('HGET', K_LEASES, lid)
  if lraw and cjson.decode(lraw).w == owner then
    redis.call('ZADD', K_LEXP, now + ttl, lid)
    return {'P', blocks, 1}
  end
  return {'P', blocks, 0}
end
local limit = meta_num('limit')
local pinned = meta_num('pbsum')
local cap = math.floor(capf * limit + 1e-9)
if pinned + blocks > cap then return {'R', pinned, cap} end
local margin
if ARGV[5] == nil or ARGV[5] == '' then
  margin = math.max(16, math.floor(0.02 * limit), math.floor(blocks / 4))  -- pins.DEFAULT_PIN_MARGIN_FRACTION
else
  margin = int_arg(ARGV[5], 'margin', 0, 1e12)
end
local track = int_arg(ARGV[6], 'track', 0, 1)
local lease = {b = blocks, h = blocks, p = 0, o = 0, w = owner, l = ttl, g = now,
               m = {pk = key, pb = blocks, pn = 1}, a = redis.call('HINCRBY', K_META, 'adm', 1)}
em_put(lid, lease)
redis.call('HSET', K_LEASES, lid, cjson.encode(lease))
redis.call('ZADD', K_LEXP, now + ttl, lid)
redis.call('HINCRBY', K_META, 'bsum', blocks)
redis.call('HINCRBY', K_META, 'hsum', blocks)
redis.call('HINCRBY', K_META, 'nl', 1)
redis.call('HINCRBY', K_META, 'pbsum', blocks)
p_save(key, {b = blocks, s = span, mg = margin, mk = meta_num('chg'), kw = 0, t = track, iu = 0, wu = 0,
             gen = lease.a})
return {'P', blocks, 1}
