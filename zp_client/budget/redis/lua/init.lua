-- init.lua: create the budget if its state is absent (a fresh Redis, or one that lost its state).
-- ARGV: limit, block_size, epoch (fresh random token), recovery_ms, policy, starvation_ms, longest_first_ms,
--       [8] fleet settings ('' for none, below), [9] line ('fifo' / 'slo'), [10] late_bound_ms,
--       [11] reserve_z and [12] reserve_k in thousandths (0..100000; elastic's forecast-error reserves,
--       common.lua's e_res: stored at creation as meta rz / rk when non-zero, read only under elastic),
--       [13] urgent_reserve in thousandths (0..100000; elastic's urgent reserve, common.lua's e_urgent:
--       meta ru, likewise)
-- The first creator's limit wins; a budget created here starts in recovery for recovery_ms (one lease
-- TTL): it admits nothing new while holders that survived a restart re-adopt their leases.
-- ARGV[8] (optional): a fleet's settings, JSON {aff, mab, cf, be, me, pxmax, smax, fttl (ms / counts,
-- see common.lua's fleet section), reps = [[replica id, url, limit, cache blocks], ...]}: the budget is
-- created in fleet mode (either policy), and the replicas are registered when the fleet has none (new, or
-- its replicas expired after fttl idle); a fleet that has replicas keeps them (membership changes go
-- through fleet.lua).
-- Returns {created (0/1), limit, block_size, epoch, policy, starvation_ms, recovery_left_ms, fleet (0/1),
--          reserve_z, reserve_k, urgent_reserve (thousandths; the stored ones: the creator's)}.
local now = now_ms()
local created = 0
if redis.call('EXISTS', K_META) == 0 then
  local limit = int_arg(ARGV[1], 'limit', 0, 1e12)
  local bs = int_arg(ARGV[2], 'block_size', 1, 1e6)
  local rec = int_arg(ARGV[4], 'recovery_ms', 0, 1e9)
  local starve = int_arg(ARGV[6], 'starvation_ms', 0, 1e15)
  local lpt = int_arg(ARGV[7] or '0', 'longest_first_ms', 0, 1e15)
  if ARGV[5] ~= 'strict' and ARGV[5] ~= 'elastic' then
    error({err = 'ERR zp: unknown policy ' .. tostring(ARGV[5])})
  end
  local line = ARGV[9] or 'fifo'
  if line ~= 'fifo' and line ~= 'slo' then error({err = 'ERR zp: unknown line ' .. tostring(line)}) end
  local lb = int_arg(ARGV[10] or '0', 'late_bound_ms', 0, 1e15)
  local rz = int_arg(ARGV[11] or '0', 'reserve_z (thousandths)', 0, 100000)
  local rk = int_arg(ARGV[12] or '0', 'reserve_k (thousandths)', 0, 100000)
  local ru = int_arg(ARGV[13] or '0', 'urgent_reserve (thousandths)', 0, 100000)
  redis.call('HSET', K_META, 'limit', limit, 'bs', bs, 'epoch', ARGV[3], 'rec', now + rec,
    'starve', starve, 'lpt', lpt, 'policy', ARGV[5], 'ver', 1, 'seq', 0, 'arr', 0, 'bsum', 0, 'hsum', 0, 'nl', 0, 'adm', 0)
  if line == 'slo' then redis.call('HSET', K_META, 'line', line, 'lb', lb, 't0', now - 549755813888) end
  if rz > 0 then redis.call('HSET', K_META, 'rz', rz) end
  if rk > 0 then redis.call('HSET', K_META, 'rk', rk) end
  if ru > 0 then redis.call('HSET', K_META, 'ru', ru) end
  created = 1
end
if ARGV[8] and ARGV[8] ~= '' then
  local f = cjson.decode(ARGV[8])
  if created == 1 then
    redis.call('HSET', K_META, 'fleet', 1, 'aff', int_arg(f.aff, 'affinity wait ms', 0, 1e9),
      'mab', int_arg(f.mab, 'min affinity blocks', 0, 1e12), 'cf', int_arg(f.cf, 'consecutive failures', 1, 1e9),
      'be', int_arg(f.be, 'base ejection ms', 0, 1e12), 'me', int_arg(f.me, 'max ejection ms', 0, 1e12),
      'pxmax', int_arg(f.pxmax, 'max prefix entries', 1, 1e9), 'smax', int_arg(f.smax, 'max sessions', 1, 1e9),
      'fttl', int_arg(f.fttl, 'fleet ttl ms', 1000, 1e12))
  end
  if redis.call('HGET', K_META, 'fleet') == '1' and redis.call('EXISTS', K_REPS) == 0 then
    for _, r in ipairs(f.reps) do
      redis.call('HSET', K_REPS, r[1], cjson.encode({u = r[2], lim = int_arg(r[3], 'limit', 0, 1e12),
        cap = int_arg(r[4], 'capacity', 1, 1e12), ej = 0, x = 0}))
    end
    redis.call('PEXPIRE', K_REPS, tonumber(redis.call('HGET', K_META, 'fttl')))
    f_relimit()
  end
end
local m = redis.call('HMGET', K_META, 'limit', 'bs', 'epoch', 'policy', 'starve', 'rec', 'fleet', 'rz', 'rk',
  'ru')
return {created, tonumber(m[1]), tonumber(m[2]), m[3], m[4], tonumber(m[5]), math.max(0, tonumber(m[6]) - now),
        tonumber(m[7] or '0'), tonumber(m[8] or '0'), tonumber(m[9] or '0'), tonumber(m[10] or '0')}
