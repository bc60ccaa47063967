-- common.lua: helpers shared by every budget script. RedisBudget prepends this file to each job
-- script before registering it, so every script stays one atomic EVALSHA with no cross-script calls.
--
-- The semantics are those of zp_client/budget/ledger.py (the reference model): one line ordered by
-- (priority, ticket order, arrival), StrictPolicy (sum of live bounds <= limit), bounded backfill with
-- the starvation rule (a non-fitting waiter that has waited >= the bound is a barrier), limit changes
-- that never revoke. Time is Redis TIME only (milliseconds). Every call does bounded work: at most
-- REAP_MAX expired leases / waiters are reaped and at most SCAN_MAX waiters examined per grant pass.
--
-- KEYS (all share the hash tag {zp:<name>}, so a budget lives in one Cluster slot):
--   1 meta   HASH  limit, bs, epoch, rec (recovery ends, ms), starve (ms), policy, ver (limit version),
--                  seq (ticket counter), arr (arrival counter), bsum (sum of bounds), hsum (sum of held),
--                  nl (live leases)
--   2 leases HASH  lease id -> cjson {b=bound, h=held, p=priority, o=order, w=owner, l=ttl ms, g=granted ms}
--   3 lexp   ZSET  lease id -> expiry (ms)
--   4 line   ZSET  member (arrival seq, zero padded, "|" id) -> priority * 2^40 + ticket order
--   5 wait   HASH  waiter id -> cjson {b, h, p, o, s=since ms, m=line member, x=mailbox, w=owner, l=lease ttl}
--   6 wexp   ZSET  waiter id -> heartbeat expiry (ms)
--   7 cls    HASH  "n<prio>" -> waiters of the class, "w<prio>" -> their weight (status without scans)
-- Mailboxes ({zp:<name>}:mb:<x>) are lists in the same slot; a grant RPUSHes the lease id to the
-- waiter's mailbox so the waiting process wakes without polling.

local K_META, K_LEASES, K_LEXP, K_LINE, K_WAIT, K_WEXP, K_CLS =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local PREFIX = string.sub(K_META, 1, -6)  -- strip ":meta"
local REAP_MAX = 32
local SCAN_MAX = 64
local PRIO_SPAN = 1099511627776  -- 2^40: ticket orders below this; priorities within +-4096 keep scores exact
local MAILBOX_TTL_MS = 60000

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Argument validation: scripts never trust the caller (no negative, fractional or huge weights).
local function int_arg(v, what, lo, hi)
  local n = tonumber(v)
  if n == nil or n ~= math.floor(n) or n < lo or n > hi then
    error({err = 'ERR zp: ' .. what .. ' must be an integer in [' .. lo .. ', ' .. hi .. '], got ' .. tostring(v)})
  end
  return n
end

local function meta_num(field)
  return tonumber(redis.call('HGET', K_META, field) or '0') or 0
end

local function class_add(p, n, w)
  local cn = redis.call('HINCRBY', K_CLS, 'n' .. p, n)
  redis.call('HINCRBY', K_CLS, 'w' .. p, w)
  if cn <= 0 then redis.call('HDEL', K_CLS, 'n' .. p, 'w' .. p) end
end

local function drop_waiter(id, w)
  redis.call('HDEL', K_WAIT, id)
  redis.call('ZREM', K_WEXP, id)
  redis.call('ZREM', K_LINE, w.m)
  class_add(w.p, -1, 0 - w.b)
end

local function drop_lease(id)
  local raw = redis.call('HGET', K_LEASES, id)
  if not raw then return nil end
  local l = cjson.decode(raw)
  redis.call('HDEL', K_LEASES, id)
  redis.call('ZREM', K_LEXP, id)
  redis.call('HINCRBY', K_META, 'bsum', 0 - l.b)  -- "0 - x", not "-x": Lua formats -0 as "-0", which HINCRBY rejects
  redis.call('HINCRBY', K_META, 'hsum', 0 - l.h)
  redis.call('HINCRBY', K_META, 'nl', -1)
  return l
end

-- Expire leases whose holder stopped renewing and waiters whose process stopped heartbeating.
local function reap(now)
  local dead = redis.call('ZRANGEBYSCORE', K_LEXP, '-inf', now, 'LIMIT', 0, REAP_MAX)
  for _, id in ipairs(dead) do drop_lease(id) end
  local gone = redis.call('ZRANGEBYSCORE', K_WEXP, '-inf', now, 'LIMIT', 0, REAP_MAX)
  for _, id in ipairs(gone) do
    local raw = redis.call('HGET', K_WAIT, id)
    if raw then drop_waiter(id, cjson.decode(raw)) else redis.call('ZREM', K_WEXP, id) end
  end
  return #dead + #gone
end

-- The reservation policy seam. 'strict' is StrictPolicy.fits; an elastic policy adds a branch here
-- reading per-lease held / forecast / prefix fields (leases carry them in their cjson record).
local function fits(policy, limit, bsum, w)
  return bsum + w.b <= limit
end

local function notify(boxes)
  for x, ids in pairs(boxes) do
    local key = PREFIX .. ':mb:' .. x
    redis.call('RPUSH', key, table.concat(ids, ','))
    redis.call('PEXPIRE', key, MAILBOX_TTL_MS)
  end
end

local function add_box(boxes, x, item)
  if x and x ~= '' then
    local box = boxes[x]
    if box then table.insert(box, item) else boxes[x] = {item} end
  end
end

-- Ledger.set_limit: a waiter larger than the limit can never be admitted; fail it ('!id' in its mailbox).
local function reject_if_too_large(id, w, limit, boxes)
  if w.b > limit then
    drop_waiter(id, w)
    add_box(boxes, w.x, '!' .. id)
    return true
  end
  return false
end

-- Ledger.grant: walk the line from the head, admit every waiter that fits; a non-fitting waiter that
-- has waited >= the starvation bound is a barrier. Admitted waiters become leases with the same id and
-- are told through their mailbox (except `self_id`, who learns it from the reply).
local function grant(now, self_id)
  if now < meta_num('rec') then return 0 end  -- recovery: live holders re-adopt first
  local limit, bsum = meta_num('limit'), meta_num('bsum')
  local starve = meta_num('starve')
  local policy = redis.call('HGET', K_META, 'policy') or 'strict'
  local members = redis.call('ZRANGE', K_LINE, 0, SCAN_MAX - 1)
  local n = 0
  local boxes = {}
  for _, m in ipairs(members) do
    local id = string.sub(m, 14)
    local raw = redis.call('HGET', K_WAIT, id)
    if not raw then
      redis.call('ZREM', K_LINE, m)  -- defensive: a line entry without its record
    else
      local w = cjson.decode(raw)
      if reject_if_too_large(id, w, limit, boxes) then
        -- failed (set_limit normally did this already; kept for waiters beyond its scan)
      elseif fits(policy, limit, bsum, w) then
        drop_waiter(id, w)
        local lease = {b = w.b, h = w.h, p = w.p, o = w.o, w = w.w, l = w.l, g = now}
        redis.call('HSET', K_LEASES, id, cjson.encode(lease))
        redis.call('ZADD', K_LEXP, now + w.l, id)
        redis.call('HINCRBY', K_META, 'hsum', w.h)
        redis.call('HINCRBY', K_META, 'nl', 1)
        bsum = redis.call('HINCRBY', K_META, 'bsum', w.b)
        n = n + 1
        if id ~= self_id then add_box(boxes, w.x, id) end
      elseif now - w.s >= starve then
        break  -- barrier: capacity drains to this waiter
      end
    end
  end
  notify(boxes)
  return n
end
