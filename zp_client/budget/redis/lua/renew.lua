-- renew.lua: heartbeat a batch of one owner's leases (Ledger.renew), recording their current held blocks.
-- A lease Redis no longer has is re-adopted when it was granted in another epoch (Redis restarted or
-- failed over and lost it: the holder really runs, so the ledger must count it again), and reported
-- lost when it was granted in the current epoch (it expired: its blocks may already be someone else's).
-- ARGV: owner, lease_ttl_ms, then per lease 7 values: id, epoch, bound, held, priority, order, meta
--       (compact JSON, elastic: a re-adopted lease keeps its projection; '' otherwise; in fleet mode
--       "<replica id>|<meta>", so a re-adopted lease counts on its replica again)
-- Returns {'I'} budget absent (call init.lua, then renew again) | {epoch, code...}, one code per lease:
--   1 renewed, 2 re-adopted, 0 lost, -1 held by another owner, -2 (fleet) released by an ejection.
if redis.call('EXISTS', K_META) == 0 then return {'I'} end
local owner = ARGV[1]
local ttl = int_arg(ARGV[2], 'lease_ttl_ms', 1, 1e9)
local now = now_ms()
stall_gap_at_least(ttl)
heard(owner, now)
reap(now)
local epoch = redis.call('HGET', K_META, 'epoch')
local out = {epoch}
local elastic = redis.call('HGET', K_META, 'policy') == 'elastic'
local fleet = redis.call('HGET', K_META, 'fleet') == '1'
for i = 3, #ARGV, 7 do
  local id, lep = ARGV[i], ARGV[i + 1]
  local raw = redis.call('HGET', K_LEASES, id)
  if raw then
    local l = cjson.decode(raw)
    if l.w ~= owner then
      table.insert(out, -1)
    else
      if l.c then  -- a pending grant its holder knows of: the renewal claims it (claim_lease)
        claim_lease(id, l, now)
      end
      if l.e then  -- renewed after a late-renewal extension (reap_late): a full TTL again
        l.e = nil
        redis.call('HSET', K_LEASES, id, cjson.encode(l))
      end
      redis.call('ZADD', K_LEXP, now + ttl, id)
      -- carry the latest held too, in case a batched report was lost
      local h = tonumber(ARGV[i + 3])
      if h and h == math.floor(h) and h >= 0 and h <= l.b and h ~= l.h then
        redis.call('HINCRBY', K_META, 'hsum', h - l.h)
        if redis.call('EXISTS', K_PINS) == 1 then redis.call('HINCRBY', K_META, 'chg', h - l.h) end
        l.h = h
        if l.a then em_put(id, l) end  -- before the record: it sets l.x
        redis.call('HSET', K_LEASES, id, cjson.encode(l))
      end
      table.insert(out, 1)
    end
  elseif lep ~= epoch and redis.call('HEXISTS', K_WAIT, id) == 0 then
    local b = int_arg(ARGV[i + 2], 'blocks', 1, 1e12)
    local h = int_arg(ARGV[i + 3], 'held', 0, b)
    local l = {b = b, h = h, p = int_arg(ARGV[i + 4], 'priority', -4096, 4096),
               o = int_arg(ARGV[i + 5], 'order', 0, 1099511627775), w = owner, l = ttl, g = now}
    local mj = ARGV[i + 6]
    if fleet then
      local rid, rest = string.match(mj, '^([^|]*)|(.*)$')
      if rid == nil then rid, rest = mj, '' end  -- a replica id alone (clients before elastic fleets)
      mj = rest
      if rid ~= '' and redis.call('HEXISTS', K_REPS, rid) == 1 then
        l.r = rid
        redis.call('HINCRBY', K_RSUM, 'b' .. l.r, b)
        redis.call('HINCRBY', K_RSUM, 'n' .. l.r, 1)
      end
    end
    if elastic then
      l.m = meta_arg(mj, false)
      l.a = redis.call('HINCRBY', K_META, 'adm', 1)
      em_put(id, l)  -- after l.r: a fleet lease mirrors into its replica's hash
    end
    redis.call('HSET', K_LEASES, id, cjson.encode(l))
    redis.call('ZADD', K_LEXP, now + ttl, id)
    redis.call('HINCRBY', K_META, 'bsum', b)
    redis.call('HINCRBY', K_META, 'hsum', h)
    redis.call('HINCRBY', K_META, 'nl', 1)
    table.insert(out, 2)
  elseif fleet and redis.call('ZSCORE', PREFIX .. ':ejl', id) then
    table.insert(out, -2)  -- released by its replica's ejection (fleet.lua)
  else
    table.insert(out, 0)
  end
end
if fleet then  -- live leases keep the fleet's replicas and their sums alive (fttl)
  local ttl = tonumber(redis.call('HGET', K_META, 'fttl') or '86400000')
  redis.call('PEXPIRE', K_REPS, ttl)
  redis.call('PEXPIRE', K_RSUM, ttl)
end
grant(now, '', owner)
return out
