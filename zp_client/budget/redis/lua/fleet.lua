-- fleet.lua: a Redis fleet's health and membership (zp_client/fleet/redis.py; fleet mode, common.lua).
-- ARGV: op, replica id, then per op:
--   fail <connect 0/1>   a failed attempt: counts a consecutive failure; ejects at cf of them, or at
--                        once for a connection that could not be made. Returns {ejected 0/1}.
--   eject                eject now. Returns {1}.
--   readmit              bring an ejected replica back (its prefix index forgotten). Returns {was 0/1}.
--   add <url> <limit> <cache blocks>   join (or come back from draining with this limit). Returns {1}.
--   remove               drain: no new request goes there; forgotten once its leases end. Returns {0/1}.
--   limit <limit>        a replica's limit (lowering never revokes). Returns {0/1}.
--   status               {now ms, reps (flat id, cjson), sums (flat), sessions, prefix entries (flat id, n),
--                        prefix evictions, used (flat id, projected peak; elastic only, else empty)}
-- Ejection releases the replica's leases at once (their holders find them lost at their next renewal;
-- a scan of the live leases, the one O(leases) step, on the rare ejection), then a grant pass places
-- waiters on the other replicas. Every change but status runs a grant pass.
if redis.call('EXISTS', K_META) == 0 or redis.call('HGET', K_META, 'fleet') ~= '1' then return {'I'} end
local op, rid = ARGV[1], ARGV[2]
local now = now_ms()
local cfg = f_cfg()

if op == 'status' then
  local reps = redis.call('HGETALL', K_REPS)
  local px, used = {}, {}
  local ec = f_ectx()
  for i = 1, #reps, 2 do
    px[#px + 1] = reps[i]
    px[#px + 1] = redis.call('ZCARD', f_px(reps[i]))
    if ec ~= nil then
      used[#used + 1] = reps[i]
      used[#used + 1] = f_prof(ec, reps[i]).peak
    end
  end
  return {now, reps, redis.call('HGETALL', K_RSUM), redis.call('ZCARD', K_SESSZ), px, meta_num('pxev'), used}
end

local raw = redis.call('HGET', K_REPS, rid)
local r = nil
if raw then
  r = cjson.decode(raw)
  r.id = rid
end

local function eject()
  if (r.le or 0) > 0 and cfg.be > 0 then
    -- the multiplier decays by one per 10 base ejection times without an ejection (as FleetLedger)
    r.x = math.max(0, (r.x or 0) - math.floor((now - r.le) / (10 * cfg.be)))
  end
  r.x = (r.x or 0) + 1
  r.le = now
  r.ej = now + math.max(1, math.min(cfg.me, cfg.be * r.x))
  redis.call('HSET', K_RSUM, 'f' .. rid, 0)
  f_save(r)
  -- its live leases stay (their streams may still run: a replica ejected for 5xx answers or a failed
  -- probe is alive), so a return, or panic mode, never admits past what it still holds; a dead
  -- replica's holders fail at once and release them. Counted for status only.
  local lost = tonumber(redis.call('HGET', K_RSUM, 'n' .. rid) or '0') or 0
  if lost > 0 then redis.call('HINCRBY', K_RSUM, 'l' .. rid, lost) end
end

local function reject_too_large()
  local slimit = size_limit(meta_num('limit'))
  local boxes = {}
  for _, m in ipairs(redis.call('ZRANGE', K_LINE, 0, 255)) do
    local id = string.sub(m, 14)
    local wraw = redis.call('HGET', K_WAIT, id)
    if wraw then reject_if_too_large(id, cjson.decode(wraw), slimit, boxes) end
  end
  notify(boxes)
end

local out
if op == 'add' then
  local lim = int_arg(ARGV[4], 'limit', 0, 1e12)
  local cap = int_arg(ARGV[5], 'capacity', 1, 1e12)
  if r == nil then
    r = {id = rid, u = ARGV[3], lim = lim, cap = cap, ej = 0, x = 0}
  else
    r.u, r.lim, r.cap, r.dr = ARGV[3], lim, cap, nil
  end
  f_save(r)
  redis.call('PEXPIRE', K_REPS, cfg.ttl)
  f_relimit()
  out = {1}
elseif r == nil then
  return {0}
elseif op == 'fail' then
  if (r.ej or 0) > now then return {1} end
  local f = redis.call('HINCRBY', K_RSUM, 'f' .. rid, 1)
  if ARGV[3] == '1' or f >= cfg.cf then
    eject()
    out = {1}
  else
    return {0}  -- nothing changed that a waiter could use
  end
elseif op == 'eject' then
  eject()
  out = {1}
elseif op == 'readmit' then
  if (r.ej or 0) == 0 then return {0} end
  r.ej = 0
  redis.call('HSET', K_RSUM, 'f' .. rid, 0)
  f_forget(rid)  -- it may have restarted: its cache is not what was recorded
  f_save(r)
  out = {1}
elseif op == 'remove' then
  r.dr = 1
  f_save(r)
  f_relimit()
  reject_too_large()
  out = {1}
elseif op == 'limit' then
  r.lim = int_arg(ARGV[3], 'limit', 0, 1e12)
  f_save(r)
  f_relimit()
  reject_too_large()
  out = {1}
else
  error({err = 'ERR zp: unknown fleet op ' .. tostring(op)})
end
reap(now)
grant(now, '')
return out
