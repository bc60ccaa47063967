-- init.lua: create the budget if its state is absent (a fresh Redis, or one that lost its state).
-- ARGV: limit, block_size, epoch (fresh random token), recovery_ms, policy, starvation_ms, longest_first_ms
-- The first creator's limit wins; a budget created here starts in recovery for recovery_ms (one lease
-- TTL): it admits nothing new while holders that survived a restart re-adopt their leases.
-- Returns {created (0/1), limit, block_size, epoch, policy, starvation_ms, recovery_left_ms}.
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
  redis.call('HSET', K_META, 'limit', limit, 'bs', bs, 'epoch', ARGV[3], 'rec', now + rec,
    'starve', starve, 'lpt', lpt, 'policy', ARGV[5], 'ver', 1, 'seq', 0, 'arr', 0, 'bsum', 0, 'hsum', 0, 'nl', 0, 'adm', 0)
  created = 1
end
local m = redis.call('HMGET', K_META, 'limit', 'bs', 'epoch', 'policy', 'starve', 'rec')
return {created, tonumber(m[1]), tonumber(m[2]), m[3], m[4], tonumber(m[5]), math.max(0, tonumber(m[6]) - now)}
