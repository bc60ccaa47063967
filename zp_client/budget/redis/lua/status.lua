-- status.lua: a read-only snapshot (writes nothing; expired leases count until the next reap).
-- Returns {exists, limit, bsum, hsum, leases, epoch, policy, starve_ms, bs, recovery_left_ms,
--          head_wait_ms, version, {class fields...}, used}; used = bsum under strict, the projected peak
--          of the live leases under elastic (a fleet: the sum of its replicas');
--          then the adaptive limit's state (adaptive.lua): its hash
--          (flat field/value list, empty when no controller ever ran), the leader's id ('' when none),
--          the leader lease's PTTL (ms; < 0 when none) and Redis's clock (ms); then the pending grants
--          (granted, not yet claimed: common.lua's claim_lease), their bounds (part of bsum) and the
--          grants returned unclaimed so far; then the held leases kept past a late renewal (meta dfr);
--          then the stored reserve_z, reserve_k and urgent_reserve (thousandths, 0 when absent: init.lua).
if redis.call('EXISTS', K_META) == 0 then return {0} end
local now = now_ms()
local m = redis.call('HMGET', K_META, 'limit', 'bsum', 'hsum', 'nl', 'epoch', 'policy', 'starve', 'bs', 'rec', 'ver',
  'cn', 'cb', 'unc', 'dfr', 'rz', 'rk', 'ru')
local head_wait = 0
local first = redis.call('ZRANGE', K_LINE, 0, 0)
if first[1] then
  local raw = redis.call('HGET', K_WAIT, string.sub(first[1], 14))
  if raw then head_wait = math.max(0, now - cjson.decode(raw).s) end
end
local used = tonumber(m[2])
if m[6] == 'elastic' then
  if redis.call('HGET', K_META, 'fleet') == '1' then
    -- a fleet: the sum of its replicas' projected peaks (each replica's leases projected on their own)
    local ec = f_ectx()
    if ec ~= nil then
      used = 0
      for _, rid in ipairs(redis.call('HKEYS', K_REPS)) do used = used + f_prof(ec, rid).peak end
    end
  else
    used = e_used()
  end
end
return {1, tonumber(m[1]), tonumber(m[2]), tonumber(m[3]), tonumber(m[4]), m[5], m[6], tonumber(m[7]),
        tonumber(m[8]), math.max(0, tonumber(m[9]) - now), head_wait, tonumber(m[10]),
        redis.call('HGETALL', K_CLS), used,
        redis.call('HGETALL', PREFIX .. ':adaptive'), redis.call('GET', PREFIX .. ':adaptive:leader') or '',
        redis.call('PTTL', PREFIX .. ':adaptive:leader'), now,
        tonumber(m[11] or '0'), tonumber(m[12] or '0'), tonumber(m[13] or '0'), tonumber(m[14] or '0'),
        tonumber(m[15] or '0'), tonumber(m[16] or '0'), tonumber(m[17] or '0')}
