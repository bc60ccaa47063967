-- acquire.lua: enqueue a waiter (Ledger.enqueue) and run a grant pass (Ledger.grant). Idempotent per
-- request id: a retry after a lost reply finds its lease or its place in line and counts nothing twice.
-- ARGV: id, bound, held, priority, ticket order (-1: take a new one), lease_ttl_ms, mailbox, owner,
--       waiter_ttl_ms, meta (compact JSON, see common.lua; '' for none; under any policy its tt/tp/ag/an
--       fields give the waiter its deadline, common.lua's SLO-aware line section; its gu field, the
--       acquire's timeout in ms, is kept as the waiter's give-up time q), heartbeat_ms (optional:
--       the process's heartbeat interval, its poll interval; kept in the waiter record with waiter_ttl_ms
--       so a grant to a dead process's waiter expires with its heartbeat, common.lua's grant),
--       claim_ms (optional: the process claims its grants; a grant pass's grant to this waiter is then
--       pending for at most claim_ms, common.lua's claim_lease; this same call, repeated after the
--       wake-up, is the claim)
-- Fleet mode (meta fleet = 1, see common.lua): ARGV[10] also carries the waiter's routing ({"k": prefix
-- keys, "s": session, "a": replicas to avoid}, beside the compact meta fields under elastic); the
-- fleet's fast path places the waiter (common.lua's f_place) when nobody waits;
-- 'G' carries the replica's URL as a sixth field, and 'W''s recovery_left_ms also covers the waiter's
-- affinity wait (its process looks again when it is over).
-- Returns {'G', order, priority, epoch, limit} granted
--       | {'W', order, priority, epoch, limit, recovery_left_ms} waiting | {'X', size limit} larger than the size limit | {'I'} budget absent (call init.lua first).
if redis.call('EXISTS', K_META) == 0 then return {'I'} end
local FLEET = redis.call('HGET', K_META, 'fleet') == '1'
if FLEET and redis.call('EXISTS', K_REPS) == 0 then return {'I'} end  -- replicas expired (fttl): register
local id = ARGV[1]
local now = now_ms()
local epoch = redis.call('HGET', K_META, 'epoch')
stall_gap_at_least(int_arg(ARGV[6], 'lease_ttl_ms', 1, 1e9))
heard(ARGV[8], now)
reap(now)
local raw = redis.call('HGET', K_LEASES, id)
if raw then
  local l = cjson.decode(raw)
  if l.w == ARGV[8] then claim_lease(id, l, now) end  -- the holder's process claims its grant
  if l.r then return {'G', l.o, l.p, epoch, meta_num('limit'), f_url(l.r)} end
  return {'G', l.o, l.p, epoch, meta_num('limit')}
end
local wraw = redis.call('HGET', K_WAIT, id)
local order, prio
if wraw then
  local w = cjson.decode(wraw)
  local slimit = size_limit(meta_num('limit'))
  if reject_if_too_large(id, w, slimit, {}) then return {'X', slimit} end
  redis.call('ZADD', K_WEXP, now + int_arg(ARGV[9], 'waiter_ttl_ms', 1, 1e9), id)
  order, prio = w.o, w.p
else
  if string.len(id) < 16 or string.len(id) > 64 then
    error({err = 'ERR zp: request id must be 16..64 characters (use an unguessable token)'})
  end
  local bound = int_arg(ARGV[2], 'blocks', 1, 1e12)
  local held = int_arg(ARGV[3], 'held', 0, bound)
  prio = int_arg(ARGV[4], 'priority', -4096, 4096)
  order = int_arg(ARGV[5], 'ticket order', -1, 1099511627775)
  local ttl = int_arg(ARGV[6], 'lease_ttl_ms', 1, 1e9)
  local wttl = int_arg(ARGV[9], 'waiter_ttl_ms', 1, 1e9)
  local mm = redis.call('HMGET', K_META, 'limit', 'bsum', 'rec', 'policy', 'nl', 'bs', 'xsum')
  local limit = tonumber(mm[1])
  if bound > size_limit(limit) then return {'X', size_limit(limit)} end
  local wmeta = nil
  if mm[4] == 'elastic' then wmeta = meta_arg(ARGV[10], false) end
  local route = nil
  if FLEET then route = f_route_arg(ARGV[10]) end
  -- Fast path, identical in outcome to enqueue + grant: with nobody in line, outside recovery, a
  -- request that fits is the head and is admitted at once (fewer commands: the common uncontended case).
  -- strict: fits is bsum + bound <= limit. elastic: a live lease's projection never exceeds its cap (its
  -- bound plus e_excess, summed over live leases in xsum) by more than one block (elastic.py, project:
  -- held + ceil((cap - ((held - 1) * bs + 1)) / bs)), nor does the candidate's while its prompt fits its
  -- bound, and shared prefixes only subtract; so bsum + xsum + nl + bound + excess + 1 <= limit implies
  -- ElasticPolicy.fits without building the projection.
  local fast = false
  -- (not while prefixes are pinned: the grant pass holds back waiters for their keep-warms, pins.py)
  if not FLEET and now >= tonumber(mm[3]) and redis.call('ZCARD', K_LINE) == 0
      and redis.call('EXISTS', K_PINS) == 0 then
    if wmeta == nil then
      fast = tonumber(mm[2]) + bound <= limit
    else
      -- (elastic's urgent reserve narrows the limit as in the grant pass: e_urgent)
      fast = tonumber(mm[2]) + (tonumber(mm[5]) or 0) + (tonumber(mm[7]) or 0) + bound + 1
          + e_excess({b = bound, m = wmeta}, tonumber(mm[6]) or 1) <= limit - e_urgent(K_UP, prio, meta_num('ru'))
        and (wmeta.pt == nil or wmeta.pt <= bound * (tonumber(mm[6]) or 0))
    end
  end
  if FLEET and now >= tonumber(mm[3]) and redis.call('ZCARD', K_LINE) == 0 then
    -- the fleet's fast path, identical in outcome to enqueue + grant (with nobody in line the grant pass
    -- examines this waiter alone): place it now; one that waits for its affinity replica enqueues
    local reps, rids = f_load(now)
    local cfg = f_cfg()
    local cand = {b = bound, h = held, p = prio, s = now, rt = route, mt = wmeta}
    local rep, matched = f_place(reps, rids, cand, now, cfg, f_ectx(), nil)
    if rep then
      if order < 0 then
        order = redis.call('HINCRBY', K_META, 'seq', 1) - 1
      elseif order >= meta_num('seq') then
        redis.call('HSET', K_META, 'seq', order + 1)
      end
      f_admit(reps, rids, rep, cand, matched, now, cfg)
      local lease = {b = bound, h = held, p = prio, o = order, w = ARGV[8], l = ttl, g = now, r = rep.id}
      if wmeta ~= nil then
        lease.m = wmeta
        lease.a = redis.call('HINCRBY', K_META, 'adm', 1)
        em_put(id, lease)  -- before the record: it sets lease.x
      end
      redis.call('HSET', K_LEASES, id, cjson.encode(lease))
      redis.call('ZADD', K_LEXP, now + ttl, id)
      redis.call('HINCRBY', K_META, 'bsum', bound)
      redis.call('HINCRBY', K_META, 'hsum', held)
      redis.call('HINCRBY', K_META, 'nl', 1)
      return {'G', order, prio, epoch, meta_num('limit'), rep.u}
    end
  end
  if fast then
    if order < 0 then
      order = redis.call('HINCRBY', K_META, 'seq', 1) - 1
    elseif order >= meta_num('seq') then
      redis.call('HSET', K_META, 'seq', order + 1)
    end
    local lease = {b = bound, h = held, p = prio, o = order, w = ARGV[8], l = ttl, g = now}
    if wmeta ~= nil then
      lease.m = wmeta
      lease.a = redis.call('HINCRBY', K_META, 'adm', 1)
    end
    if wmeta ~= nil then em_put(id, lease) end  -- before the record: it sets lease.x
    redis.call('HSET', K_LEASES, id, cjson.encode(lease))
    redis.call('ZADD', K_LEXP, now + ttl, id)
    redis.call('HINCRBY', K_META, 'bsum', bound)
    redis.call('HINCRBY', K_META, 'hsum', held)
    redis.call('HINCRBY', K_META, 'nl', 1)
    return {'G', order, prio, epoch, limit}
  end
  if order < 0 then
    order = redis.call('HINCRBY', K_META, 'seq', 1) - 1
  elseif order >= meta_num('seq') then
    -- a ticket from elsewhere must not let later arrivals slip in ahead of it
    redis.call('HSET', K_META, 'seq', order + 1)
  end
  local arrival = redis.call('HINCRBY', K_META, 'arr', 1)
  local member = string.format('%012d', arrival) .. '|' .. id
  local lf = l_arg(ARGV[10])
  local dl = nil
  if lf ~= nil then dl = now - lf.ag + lf.tt + lf.an end  -- the deadline on Redis TIME (ledger.line_deadline)
  -- q: when the waiter's acquire gives up (its timeout, meta gu in ms, on Redis TIME): read by nothing
  -- here, only by the client's wait prediction (snapshot.lua), which takes it out of the replayed line then
  local q = nil
  if ARGV[10] and string.find(ARGV[10], '"gu"', 1, true) then
    local ok, mg = pcall(cjson.decode, ARGV[10])
    if ok and type(mg) == 'table' and type(mg.gu) == 'number' and mg.gu >= 0 and mg.gu <= 1e12 then
      q = now + math.floor(mg.gu)
    end
  end
  redis.call('HSET', K_WAIT, id, cjson.encode({b = bound, h = held, p = prio, o = order, s = now,
    m = member, x = ARGV[7], w = ARGV[8], l = ttl, mt = wmeta, rt = route, d = dl, tp = lf and lf.tp,
    t = wttl, hb = ARGV[11] and int_arg(ARGV[11], 'heartbeat_ms', 1, 1e9) or nil,
    cw = ARGV[12] and int_arg(ARGV[12], 'claim_ms', 1, 1e9) or nil, q = q}))
  redis.call('ZADD', K_LINE, prio * PRIO_SPAN + order, member)
  if dl ~= nil and redis.call('HGET', K_META, 'line') == 'slo' then
    redis.call('ZADD', K_DL, l_score(prio, dl, meta_num('t0')), member)
  end
  redis.call('ZADD', K_WEXP, now + wttl, id)
  class_add(prio, 1, bound)
end
grant(now, id, ARGV[8])
local limit = meta_num('limit')
local lraw = redis.call('HGET', K_LEASES, id)
if lraw then
  if FLEET then return {'G', order, prio, epoch, limit, f_url(cjson.decode(lraw).r)} end
  return {'G', order, prio, epoch, limit}
end
local wraw2 = redis.call('HGET', K_WAIT, id)
if not wraw2 then return {'X', limit} end
local left = math.max(0, meta_num('rec') - now)
if FLEET then
  local w = cjson.decode(wraw2)
  if w.rt and (w.rt.k or w.rt.s) then
    left = math.max(left, w.s + tonumber(redis.call('HGET', K_META, 'aff') or '500') + 1 - now)
  end
end
return {'W', order, prio, epoch, limit, left}
