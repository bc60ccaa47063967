-- common.lua: helpers shared by every budget script. RedisBudget prepends this file to each job
-- script before registering it, so every script stays one atomic EVALSHA with no cross-script calls.
--
-- The semantics are those of zp_client/budget/ledger.py (the reference model): one line ordered by
-- (priority, ticket order, arrival), StrictPolicy (sum of live bounds <= limit) or ElasticPolicy
-- (projected peak <= limit; the elastic section below; with the budget's longest-first window, lpt, its
-- grant walks the young waiters of a class longest forecast first, e_walk), bounded backfill with
-- the starvation rule (a non-fitting waiter that has waited >= the bound is a barrier), limit changes
-- that never revoke. Time is Redis TIME only (milliseconds). Every call does bounded work: at most
-- REAP_MAX expired leases / waiters are reaped and at most SCAN_MAX waiters examined per grant pass.
--
-- KEYS: the meta key only (callers may pass all seven; the rest are read from the prefix, like the mailboxes
-- and the elastic mirror: fewer arguments per call). All share the hash tag {zp:<name>}, so a budget
-- lives in one Cluster slot and the declared key routes every call there:
--   1 meta   HASH  limit, bs, epoch, rec (recovery ends, ms), starve (ms), lpt (longest-first window, ms;
--                  absent in budgets made before it: 0, off), line ('slo' for the SLO-aware line, absent:
--                  fifo), lb (its late bound, ms), t0 (its deadline scores' origin, ms), policy, ver (limit version),
--                  seq (ticket counter), arr (arrival counter), bsum (sum of bounds), hsum (sum of held),
--                  nl (live leases), adm (elastic admission counter), xsum (elastic: sum of the live
--                  leases' excess blocks beyond their bounds, e_excess; absent: 0), lt (TIME of the
--                  last reap), sg (the gap that counts as a stall, ms), stalls (stall_shift), cn / cb
--                  (pending grants and their bounds, part of bsum), unc (grants returned unclaimed)
--   2 leases HASH  lease id -> cjson {b=bound, h=held, p=priority, o=order, w=owner, l=ttl ms, g=granted ms,
--                  m=meta, a=admission seq and x=excess blocks when > 0 (elastic only; see the elastic
--                  section), c=1 while a pending grant (claim_lease)}
--   3 lexp   ZSET  lease id -> expiry (ms)
--   4 line   ZSET  member (arrival seq, zero padded, "|" id) -> priority * 2^40 + ticket order
--   5 wait   HASH  waiter id -> cjson {b, h, p, o, s=since ms, m=line member, x=mailbox, w=owner, l=lease ttl,
--                  mt=meta (elastic only), d=TTFT deadline ms and tp=TPOT target ms (with a TTFT target;
--                  the SLO-aware line's section), t=waiter ttl ms and hb=heartbeat interval ms of its
--                  process (clients since issue 33; grant: a dead process's waiters), cw=claim window ms
--                  (clients that claim their grants: claim_lease), q=when its acquire gives up (ms;
--                  read only by the client's wait prediction, snapshot.lua)}
--   6 wexp   ZSET  waiter id -> heartbeat expiry (ms)
--   7 cls    HASH  "n<prio>" -> waiters of the class, "w<prio>" -> their weight (status without scans)
-- Read from the prefix too: pl ZSET owner -> TIME (ms) of that process's last script call (heard; reap's
-- late-renewal rule), trimmed to the longest lease TTL seen. Lease record field e = ms of extension a
-- lease whose renewal is late still has beyond its current expiry (reap); meta dfr counts such leases.
-- Mailboxes ({zp:<name>}:mb:<x>) are lists in the same slot; a grant RPUSHes the lease id to the
-- waiter's mailbox so the waiting process wakes without polling (comma-separated items: 'id' a grant to
-- claim, '+id' a grant already claimed, '!id' too large for the limit; fleet: 'id@<replica id>').

local K_META = KEYS[1]
local PREFIX = string.sub(K_META, 1, -6)  -- strip ":meta"
local K_LEASES, K_LEXP, K_LINE, K_WAIT, K_WEXP, K_CLS =
  PREFIX .. ':leases', PREFIX .. ':lexp', PREFIX .. ':line', PREFIX .. ':wait', PREFIX .. ':wexp', PREFIX .. ':cls'
local K_PL = PREFIX .. ':pl'
local REAP_MAX = 32
local SCAN_MAX = 64
local PRIO_SPAN = 1099511627776  -- 2^40: ticket orders below this; priorities within +-4096 keep scores exact
local MAILBOX_TTL_MS = 60000
-- elastic only: a mirror of every live lease's projection inputs as one short string (parsing it costs a
-- third of decoding the lease's cjson record, and a grant pass reads them all):
--   "held bound adm pt tk ft st pb f1 mo [fh] pk" with -1 for an absent number and pk as "=<key>" or "-"
--   ("*<key>": a pinned prefix's own lease, meta pn = 1; the pins section below). pk stays last (a key
--   may hold spaces); fh (forecast_hi, read by the forecast-error reserves) came after mo later and is
--   written only when the lease has one (em_put): e_parse reads a mirror without it as fh absent, and a
--   script before it reads such a mirror (a pin's, a lease without an upper forecast) right.
-- A fleet's elastic leases mirror into one hash per replica instead, :em:<replica id> (a placement reads
-- the leases of the replicas it weighs, not the whole fleet's).
local K_EM = PREFIX .. ':em'
local function em_key(l)
  if l.r then return K_EM .. ':' .. l.r end
  return K_EM
end
-- fleet mode (meta field fleet = 1; zp_client/fleet/redis.py, the fleet section below): the replicas
-- (replica id -> cjson {u=url, lim=limit, cap=cache blocks, ej=ejected until ms or 0, x=ejections,
-- le=last ejected ms, dr=1 draining}) and their counters (HINCRBY fields "<c><replica id>": b bound sum,
-- n leases, f consecutive failures, k prefix-index blocks, p placed, q prompt blocks, h hit blocks,
-- l leases lost to ejections).
local K_REPS, K_RSUM = PREFIX .. ':reps', PREFIX .. ':rsum'

-- elastic's urgent reserve (ElasticPolicy.urgent_blocks; meta field ru = urgent_reserve in thousandths,
-- stored at creation, absent: off): every live elastic lease except a pin's is also a member of :up
-- (a fleet's: :up:<replica id>), scored priority * 2^40 + bound, so the largest bound among the leases of
-- the classes more urgent than a waiter's costs one bounded ZREVRANGEBYSCORE per such class (e_urgent).
local K_UP = PREFIX .. ':up'
local function up_key(l)
  if l.r then return K_UP .. ':' .. l.r end
  return K_UP
end

-- elastic.excess_blocks: blocks by which a lease's cap, max(bound * bs, pt + mo) when both are known,
-- exceeds its bound (the exact prompt outgrew the estimate the bound was sized on).
local function e_excess(l, bs)
  local m = l.m or {}
  if m.pt == nil or m.mo == nil then return 0 end
  return math.max(0, -math.floor(-math.max(l.b * bs, m.pt + m.mo) / bs) - l.b)
end

-- Write a live elastic lease's mirror and keep meta field xsum (the sum of e_excess over live leases,
-- read by acquire.lua's fast path) with the lease's own excess in record field x. Call it before the
-- lease record is written (it sets l.x), and after l.r in a fleet (the replica's mirror).
local function em_put(id, l)
  local m = l.m or {}
  local x = 0
  if m.pt ~= nil and m.mo ~= nil then x = e_excess(l, tonumber(redis.call('HGET', K_META, 'bs'))) end
  if x ~= (l.x or 0) then
    redis.call('HINCRBY', K_META, 'xsum', x - (l.x or 0))
    if x == 0 then l.x = nil else l.x = x end
  end
  -- fh only when the lease has one: a mirror without it is the format of the scripts before fh, which a
  -- process still running them reads right (with fh in it they would read its prefix key as absent, and a
  -- pin's as an ordinary lease ending at once)
  local f = {l.h, l.b, l.a or 0, m.pt or -1, m.tk or -1, m.ft or -1, m.st or -1, m.pb or -1, m.f1 or -1,
    m.mo or -1}
  if m.fh ~= nil then f[#f + 1] = m.fh end
  f[#f + 1] = m.pk and ((m.pn == 1 and '*' or '=') .. m.pk) or '-'
  redis.call('HSET', em_key(l), id, table.concat(f, ' '))
  if m.pn ~= 1 and l.p ~= nil then redis.call('ZADD', up_key(l), l.p * 1099511627776 + l.b, id) end
end

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

-- The SLO-aware line (zp_client/budget/ledger.py: line_deadline, slo_walk; meta fields line = 'slo',
-- lb = late bound ms, t0 = a time origin 2^39 ms before the budget's creation). A waiter whose acquire
-- meta carries tt (TTFT target ms) has record field d = its deadline on Redis TIME, now - ag + tt + an
-- (ag: the request's age ms, a retry's; an: a non-streamed call's answer allowance ms, forecast output
-- tokens x TPOT target, absent 0; tp, the TPOT target ms, is kept beside it); under line = 'slo' its
-- line member is also in :dl, scored priority * 2^40 + (d - t0) (clamped to the span), so a grant pass
-- finds a class's waiters whose deadline is ahead, earliest first, in one bounded ZRANGEBYSCORE.
local K_DL = PREFIX .. ':dl'

local function l_score(p, d, t0)
  local rel = math.min(math.max(d - t0, 0), PRIO_SPAN - 1)
  return string.format('%.0f', p * PRIO_SPAN + rel)
end

local function drop_waiter(id, w)
  redis.call('HDEL', K_WAIT, id)
  redis.call('ZREM', K_WEXP, id)
  redis.call('ZREM', K_LINE, w.m)
  if w.d ~= nil then redis.call('ZREM', K_DL, w.m) end
  class_add(w.p, -1, 0 - w.b)
end

-- The line's fields of acquire's meta argument (_script.line_meta): {tt, tp, ag, an} in ms, or nil without
-- a TTFT target. A malformed object is meta_arg's / f_route_arg's to report (strict ignores it: nil).
local function l_arg(raw)
  if raw == nil or raw == '' then return nil end
  local ok, m = pcall(cjson.decode, raw)
  if not ok or type(m) ~= 'table' or m.tt == nil or m.tt == cjson.null then return nil end
  local out = {tt = int_arg(m.tt, 'meta tt (TTFT target ms)', 1, 1e12),
               ag = int_arg(m.ag or 0, 'meta ag (age ms)', 0, 1e12),
               an = int_arg(m.an or 0, 'meta an (answer allowance ms)', 0, 1e12)}
  if m.tp ~= nil and m.tp ~= cjson.null then out.tp = int_arg(m.tp, 'meta tp (TPOT target ms)', 1, 1e12) end
  return out
end

-- ------------------------------------------------------------------------------------------------
-- pinned prefixes: a port of zp_client/budget/pins.py (PinBook), the Python ledger the model.
--   pins   HASH  prefix key -> cjson {b=blocks (shared), s=span (the prefix's blocks on the server, an
--                upper bound), mg=margin, mk=charged count at the last release (mark), f=server's free
--                blocks then (absent: never used yet), cu=keep-warm claimed until (ms), gs=a waiter held
--                back since (ms), kw=keep-warms claimed, t=track (1/0), iu=members past their first
--                token, wu=members before it, gen=the pin lease's admission seq}
-- meta fields: chg (blocks charged on the server since the first pin: admissions less pinned shares,
-- growth; counted only while pins exist, which is all the marks need), psh (sum of the live members'
-- shares), pbsum (pinned blocks), pool (the server's usable pool; absent: the limit).
-- A pin's own lease is "pin:<key>" with meta {pk, pb, pn = 1}: held by the process that pinned it and
-- renewed by it (pin.lua again), so a pin whose process died expires with its lease. Members carry
-- pm ('w' before the first token, 'u' after), ps (share) and pg (the pin's gen) in their lease record.
local K_PINS = PREFIX .. ':pins'
local PIN_GATE_MS = 10000  -- pins.DEFAULT_PIN_GATE_TIMEOUT_S

local function p_load()
  if redis.call('EXISTS', K_PINS) == 0 then return nil end
  local flat = redis.call('HGETALL', K_PINS)
  local out = {}
  for i = 1, #flat, 2 do out[flat[i]] = cjson.decode(flat[i + 1]) end
  return out
end

local function p_save(key, p)
  redis.call('HSET', K_PINS, key, cjson.encode(p))
end

local function p_share(p, m, h)
  return math.max(0, math.min(p.b, m.pb or p.b, h))
end

-- Ledger.server_free: the pool less what live leases hold, a pinned prefix once, an idle one not at all.
local function p_server_free(pins)
  local pool = tonumber(redis.call('HGET', K_META, 'pool') or '0') or 0
  if pool <= 0 then pool = tonumber(redis.call('HGET', K_META, 'limit')) end
  local idle = 0
  for _, p in pairs(pins) do
    if (p.iu or 0) == 0 and (p.wu or 0) == 0 then idle = idle + p.b end
  end
  return pool - (tonumber(redis.call('HGET', K_META, 'hsum') or '0') - tonumber(
    redis.call('HGET', K_META, 'psh') or '0') - idle)
end

local function p_line(p)
  if p.f == nil then return nil end
  return p.f - math.max(p.b, p.s or p.b) - p.mg
end

-- PinBook.admitted for a lease record about to be written (pins: p_load()'s table, nil: none).
local function p_admitted(lease, pins)
  if pins == nil then return end
  local m = lease.m or {}
  local p = nil
  if m.pk ~= nil and m.pn ~= 1 then p = pins[m.pk] end
  local share = 0
  if p then share = p_share(p, m, lease.h) end
  redis.call('HINCRBY', K_META, 'chg', math.max(0, lease.h - share))
  if p then
    lease.ps, lease.pg = share, p.gen
    redis.call('HINCRBY', K_META, 'psh', share)
    if m.f1 == 1 then
      lease.pm, p.iu = 'u', (p.iu or 0) + 1
    else
      lease.pm, p.wu = 'w', (p.wu or 0) + 1
    end
    p_save(m.pk, p)
  end
end

-- PinBook.first_token for a lease record whose meta just got f1 = 1 (the caller writes the record).
local function p_first_token(l)
  if l.pm ~= 'w' then return end
  l.pm = 'u'
  local raw = redis.call('HGET', K_PINS, l.m.pk)
  if not raw then return end
  local p = cjson.decode(raw)
  if p.gen ~= l.pg then return end
  p.wu = math.max(0, (p.wu or 0) - 1)
  p.iu = (p.iu or 0) + 1
  p.cu, p.gs = nil, nil
  p_save(l.m.pk, p)
end

-- PinBook.released / remove for a lease record just dropped.
local function p_dropped(l)
  local m = l.m or {}
  if m.pn == 1 then
    if redis.call('HDEL', K_PINS, m.pk) == 1 then redis.call('HINCRBY', K_META, 'pbsum', 0 - l.b) end
    return
  end
  if l.pm == nil then return end
  redis.call('HINCRBY', K_META, 'psh', 0 - (l.ps or 0))
  local raw = redis.call('HGET', K_PINS, m.pk)
  if not raw then return end
  local p = cjson.decode(raw)
  if p.gen ~= l.pg then return end  -- a member of an earlier pin of the same key
  if l.pm == 'u' then
    p.iu = math.max(0, (p.iu or 0) - 1)
    if p.iu == 0 then
      -- the prefix went back to the free queue's tail: a new count starts
      p_save(m.pk, p)
      p.mk = tonumber(redis.call('HGET', K_META, 'chg') or '0')
      p.f = math.max(0, p_server_free(p_load()))
      p.gs = nil
    end
  else
    p.wu = math.max(0, (p.wu or 0) - 1)
  end
  p_save(m.pk, p)
end

-- PinBook.holds_back: whether waiter w must wait for a keep-warm's first token (every pin it would
-- push past its line is marked gated, as the Python ledger walks them all).
local function p_holds_back(pins, w, now)
  local m = w.mt or {}
  local own = m.pk
  local share = 0
  if own ~= nil and pins[own] then share = p_share(pins[own], m, w.h) end
  local charge = math.max(0, w.h - share)
  local chg = tonumber(redis.call('HGET', K_META, 'chg') or '0')
  local held = false
  for k, p in pairs(pins) do
    local line = p_line(p)
    if k ~= own and (p.iu or 0) == 0 and p.t == 1 and line ~= nil then
      local since = chg - p.mk
      if since ~= 0 and since + charge > line then
        if p.gs == nil then
          p.gs = now
          p_save(k, p)
        end
        if now - p.gs < PIN_GATE_MS then held = true end
      end
    end
  end
  return held
end

-- PinBook.due: keys whose keep-warm is due and not claimed, sorted.
local function p_due(pins, now)
  local out = {}
  local chg = tonumber(redis.call('HGET', K_META, 'chg') or '0')
  for k, p in pairs(pins) do
    local line = p_line(p)
    if p.t == 1 and (p.iu or 0) == 0 and (p.wu or 0) == 0 and not (p.cu ~= nil and p.cu > now)
        and line ~= nil and (p.gs ~= nil or chg - p.mk >= line - p.mg) then
      out[#out + 1] = k
    end
  end
  table.sort(out)
  return out
end

local function drop_lease(id, raw)  -- raw: the lease's record when the caller read it already
  raw = raw or redis.call('HGET', K_LEASES, id)
  if not raw then return nil end
  local l = cjson.decode(raw)
  redis.call('HDEL', K_LEASES, id)
  redis.call('ZREM', K_LEXP, id)
  if l.a then  -- an elastic lease (strict ones have no mirror)
    redis.call('HDEL', em_key(l), id)
    redis.call('ZREM', up_key(l), id)
  end
  if l.x then redis.call('HINCRBY', K_META, 'xsum', 0 - l.x) end
  redis.call('HINCRBY', K_META, 'bsum', 0 - l.b)  -- "0 - x", not "-x": Lua formats -0 as "-0", which HINCRBY rejects
  redis.call('HINCRBY', K_META, 'hsum', 0 - l.h)
  redis.call('HINCRBY', K_META, 'nl', -1)
  if l.c then  -- a pending grant (never claimed)
    redis.call('HINCRBY', K_META, 'cn', -1)
    redis.call('HINCRBY', K_META, 'cb', 0 - l.b)
  end
  if l.pm ~= nil or (l.m and l.m.pn == 1) then p_dropped(l) end
  if l.r then  -- a fleet lease: its replica's sums
    redis.call('HINCRBY', K_RSUM, 'b' .. l.r, 0 - l.b)
    redis.call('HINCRBY', K_RSUM, 'n' .. l.r, -1)
  end
  return l
end

-- Grants are claimed (Ledger.claim; docs/redis.md, "Grants are claimed"). A grant pass's grant to another
-- process's waiter that announced a claim window (acquire's ARGV[12], record field cw) is *pending*:
-- record field c = 1, its lexp score the end of its claim window (grant + cw), counted in bsum (reserved:
-- nothing is over-admitted) and in meta cn / cb (pending grants / their bounds), not yet anybody's held
-- lease. The holder's process claims it with a call of its own that learns of the grant (acquire's
-- idempotent repeat after a mailbox wake-up, poll's 'G', a renewal): the record loses c and the lease
-- expires one lease TTL from the claim, like a renewal. A grant made by a call of the waiter's own
-- process (its acquire, release, renewal or held report: grant's caller) is claimed as it is made.
-- reap returns an unclaimed grant to the pool at the end of its window (meta unc counts them) and drops
-- nothing else: its waiter left the line at the grant, and a live process that was only late finds it
-- gone and enqueues again with the same ticket.
local function claim_lease(id, l, now)
  if not l.c then return end
  l.c = nil
  redis.call('HSET', K_LEASES, id, cjson.encode(l))
  redis.call('ZADD', K_LEXP, now + l.l, id)
  redis.call('HINCRBY', K_META, 'cn', -1)
  redis.call('HINCRBY', K_META, 'cb', 0 - l.b)
end

-- A Redis stall (SIGSTOP, a long fork, a failover pause, a partition from every client) does not
-- count against the holders: nobody could renew while Redis did not answer, yet the leases expire on
-- Redis's own clock. The first reaping call after a gap between two calls longer than meta sg (half
-- the longest lease TTL seen: live holders renew every TTL / 3, so a normal gap is shorter) moves
-- every lease and waiter expiry still ahead at the last call (>= lt) forward by the gap: a holder gets
-- back the time it had left when Redis went silent, at least one renewal interval, before its lease
-- can be reclaimed. O(live leases + waiters), only on such a gap. Meta lt: TIME of the last reap,
-- stalls: the gaps seen.
local function stall_gap_at_least(ttl)
  local sg = math.floor(ttl / 2)
  if (tonumber(redis.call('HGET', K_META, 'sg')) or 0) < sg then redis.call('HSET', K_META, 'sg', sg) end
end

local function stall_shift(now)
  local mm = redis.call('HMGET', K_META, 'lt', 'sg')
  local lt, sg = tonumber(mm[1]), tonumber(mm[2])
  redis.call('HSET', K_META, 'lt', now)
  if lt == nil or sg == nil or now - lt <= sg then return end
  local gap = now - lt
  for _, z in ipairs({K_LEXP, K_WEXP}) do
    local live = redis.call('ZRANGEBYSCORE', z, lt, '+inf', 'WITHSCORES')
    local args = {}
    for i = 1, #live, 2 do
      args[#args + 1] = tonumber(live[i + 1]) + gap
      args[#args + 1] = live[i]
      if #args >= 1000 then
        redis.call('ZADD', z, 'XX', unpack(args))
        args = {}
      end
    end
    if #args > 0 then redis.call('ZADD', z, 'XX', unpack(args)) end
  end
  redis.call('HINCRBY', K_META, 'stalls', 1)
end

-- A process that talks to Redis is alive (Ledger.heard; docs/redis.md, "A late renewal of a live
-- process"): every script call that names its owner records its TIME here, before it reaps, so the
-- caller's own leases are judged with this call counted. Entries older than the longest lease TTL seen
-- can extend nothing and are trimmed (at most one per dead process; O(log n + removed)).
local function heard(owner, now)
  if owner == nil or owner == '' then return end
  redis.call('ZADD', K_PL, now, owner)
  local sg = tonumber(redis.call('HGET', K_META, 'sg'))
  if sg then redis.call('ZREMRANGEBYSCORE', K_PL, '-inf', '(' .. (now - 2 * sg - 1)) end
end

-- A held lease whose expiry came is reclaimed only one TTL after the later of its last renewal and
-- its process's last call of any kind (Ledger.expire), and never later than one more TTL after the
-- expiry its last renewal gave it: a process whose other calls reach Redis is alive and its renewal is
-- only late (queued behind scripts), yet a live process that stopped renewing a lease loses it one TTL
-- late at most. Record field e carries the extension left beyond the new expiry (relative, so a stall
-- shift of the expiry keeps it right); a renewal clears it. Returns true when the lease was kept, else
-- false and the record (nil when there is none) for drop_lease.
local function reap_late(id, now)
  local raw = redis.call('HGET', K_LEASES, id)
  if not raw then return false, nil end
  local l = cjson.decode(raw)
  if l.c or not l.w or not l.l then return false, raw end  -- a pending grant: its claim window is its bound
  local a = tonumber(redis.call('ZSCORE', K_PL, l.w))
  if a == nil then return false, raw end
  local due = tonumber(redis.call('ZSCORE', K_LEXP, id))
  local cap = due + (l.e or l.l)
  local n = math.min(a + l.l, cap)
  if n <= now then return false, raw end
  if l.e == nil then redis.call('HINCRBY', K_META, 'dfr', 1) end
  l.e = cap - n
  redis.call('HSET', K_LEASES, id, cjson.encode(l))
  redis.call('ZADD', K_LEXP, n, id)
  return true
end

-- Expire leases whose holder stopped renewing and waiters whose process stopped heartbeating.
local function reap(now)
  stall_shift(now)
  local dead = redis.call('ZRANGEBYSCORE', K_LEXP, '-inf', now, 'LIMIT', 0, REAP_MAX)
  for _, id in ipairs(dead) do
    local kept, raw = reap_late(id, now)
    if not kept then
      local l = raw and drop_lease(id, raw)
      if not raw then redis.call('ZREM', K_LEXP, id) end
      if l and l.c then redis.call('HINCRBY', K_META, 'unc', 1) end  -- a grant nobody claimed
    end
  end
  local gone = redis.call('ZRANGEBYSCORE', K_WEXP, '-inf', now, 'LIMIT', 0, REAP_MAX)
  for _, id in ipairs(gone) do
    local raw = redis.call('HGET', K_WAIT, id)
    if raw then drop_waiter(id, cjson.decode(raw)) else redis.call('ZREM', K_WEXP, id) end
  end
  return #dead + #gone
end

-- The reservation policy seam. 'strict' is StrictPolicy.fits (sum of live bounds). 'elastic' is
-- ElasticPolicy.fits (zp_client/budget/elastic.py), ported exactly: see the elastic section below.
local function fits(policy, limit, bsum, w)
  return bsum + w.b <= limit
end

-- ------------------------------------------------------------------------------------------------
-- elastic: admit while the projected peak of the pool, with the candidate, stays within the limit.
-- A port of zp_client/budget/elastic.py (project, _terms_for, _Profile.peak / peak_with,
-- ElasticPolicy.fits); the Python ledger with ElasticPolicy is the model in the conformance suite.
-- Leases and waiters carry their metadata compactly in their record, field m:
--   pt prompt_tokens, tk tokens, ft forecast_tokens, st streaming (0/1), pk prefix_key,
--   pb prefix_blocks, f1 first_token (0/1), mo max_output_tokens, fh forecast_hi (read only by the
--   forecast-error reserves, below; never by the projection); an absent field is absent (the Python
--   default applies).
-- Leases also carry a = admission sequence: the Python ledger walks leases in admission order, and
-- the group prefix of a key is that of the last admitted member with first_token (exactness).
-- Cost per grant pass: one HVALS of the live leases' projection mirror (K_EM below), O(n log n) to
-- prepare, O(n) per candidate examined (at most SCAN_MAX), O(n log n) again after each admission
-- (measured: ~3 ms for a pass over 1,000 live leases; benchmarks/bench_redis_elastic.py). Above ELASTIC_MAX_LEASES live
-- leases the pass falls back to the strict rule (sum of bounds, as strict counts: a lease whose exact
-- prompt outgrew its estimate may occupy a few blocks more; the headroom covers that, as under strict),
-- and it keeps a script call bounded.
local ELASTIC_MAX_LEASES = 4096

local function cdiv(a, b)
  return -math.floor(-a / b)
end

-- project(): returns blocks, remaining, grows.
local FOREVER = 9007199254740992  -- 2^53, elastic.FOREVER
local function e_project(held, bound, bs, m, candidate)
  if m.pn == 1 then return bound, FOREVER, false end  -- a pinned prefix: its blocks for as long as pinned
  if m.pt == nil and m.tk == nil and m.ft == nil and m.st == nil and m.pk == nil and m.pb == nil
      and m.f1 == nil then
    -- no metadata: reserved at its bound for its whole life, as strict counts it
    return bound, FOREVER, false
  end
  local pt = m.pt
  if pt == nil then pt = held * bs end
  -- the cap (elastic.cap_tokens): the bound, or the exact prompt plus the output bound when more
  local bt = bound * bs
  if m.pt ~= nil and m.mo ~= nil then bt = math.max(bt, m.pt + m.mo) end
  local et = bt
  if m.ft ~= nil then et = math.min(bt, pt + m.ft) end
  if m.st == 0 then
    -- not streamed: the client cannot see growth; hold the forecast end while the forecast runs
    return math.min(cdiv(bt, bs), cdiv(et, bs)), math.max(0, et - pt), false
  end
  if candidate then held = cdiv(pt, bs) end
  local low = pt
  if held > 0 then low = math.max(pt, (held - 1) * bs + 1) end
  if m.tk ~= nil and not candidate then low = math.max(low, math.min(m.tk, held * bs)) end
  if low >= et and et < bt then et = bt end  -- outgrew its forecast: project to the cap
  return held, math.max(0, et - low), true
end

-- The forecast-error reserves (elastic.spread_blocks, spread_reserve, risk_reserve; ElasticPolicy.reserve):
-- admission past the fast path keeps spread_reserve(sum of spread^2, z) + risk_reserve(sum of spread, k)
-- blocks free below the limit, over the live leases and the candidate. Meta rz / rk: reserve_z / reserve_k
-- in thousandths (as the Python takes them; absent: 0, off), written by init.lua at creation.
local E_RES = nil  -- read once per script call
local function e_res()
  if E_RES == nil then
    local m = redis.call('HMGET', K_META, 'rz', 'rk')
    local z, k = tonumber(m[1]) or 0, tonumber(m[2]) or 0
    E_RES = {z = z, k = k, on = z > 0 or k > 0}
  end
  return E_RES
end

-- elastic.spread_blocks: a live streaming lease's forecast uncertainty in blocks (its end at forecast_hi,
-- fh, less its projected end, both capped), read as e_project reads it (candidate: a waiter).
local function e_spread(held, bound, bs, m, candidate)
  if m.pt == nil and m.tk == nil and m.ft == nil and m.st == nil and m.pk == nil and m.pb == nil
      and m.f1 == nil then return 0 end
  if m.st == 0 or m.ft == nil or m.fh == nil then return 0 end
  local pt = m.pt
  if pt == nil then pt = held * bs end
  local bt = bound * bs
  if m.pt ~= nil and m.mo ~= nil then bt = math.max(bt, m.pt + m.mo) end
  local et = math.min(bt, pt + m.ft)
  if candidate then held = cdiv(pt, bs) end
  local low = pt
  if held > 0 then low = math.max(pt, (held - 1) * bs + 1) end
  if m.tk ~= nil and not candidate then low = math.max(low, math.min(m.tk, held * bs)) end
  if low >= et then return 0 end
  local hi = math.min(bt, pt + math.max(m.fh, m.ft))
  return math.max(0, cdiv(hi, bs) - cdiv(et, bs))
end

-- Exact integers past 2^53 for the spread reserve's squares: little-endian limbs of 2^24, each below
-- 2^24 once normalized, every intermediate below 2^53 (a spread is below 2^41 blocks: the cap is at most
-- max(bound, (pt + mo) / bs) blocks with bound, pt and mo at most 1e12).
local BN = 16777216
local function bn_norm(a)
  local c = 0
  for i = 1, #a do
    local v = a[i] + c
    c = math.floor(v / BN)
    a[i] = v - c * BN
  end
  while c > 0 do
    local q = math.floor(c / BN)
    a[#a + 1] = c - q * BN
    c = q
  end
  return a
end

local function bn_copy(a)
  local out = {}
  for i = 1, #a do out[i] = a[i] end
  return out
end

-- a += u^2 for an integer 0 <= u < 2^48 (u = hi 2^24 + lo: three partial products below 2^49)
local function bn_add_sq(a, u)
  local hi = math.floor(u / BN)
  local lo = u - hi * BN
  for i = #a + 1, 3 do a[i] = 0 end
  a[1] = a[1] + lo * lo
  a[2] = a[2] + 2 * hi * lo
  a[3] = a[3] + hi * hi
  bn_norm(a)
end

-- a * k for an integer 0 <= k < 2^29 (a new number)
local function bn_mul_small(a, k)
  local out = {}
  for i = 1, #a do out[i] = a[i] * k end
  return bn_norm(out)
end

local function bn_cmp(a, b)
  local n = math.max(#a, #b)
  for i = n, 1, -1 do
    local x, y = a[i] or 0, b[i] or 0
    if x ~= y then return x < y and -1 or 1 end
  end
  return 0
end

local function bn_float(a)
  local v = 0
  for i = #a, 1, -1 do v = v * BN + a[i] end
  return v
end

-- 10^6 r^2 for an integer 0 <= r < 2^48
local function bn_sq1e6(r)
  local a = {0}
  bn_add_sq(a, r)
  return bn_mul_small(a, 1000000)
end

-- elastic.spread_reserve: ceil(z sqrt(s)) with z = zm / 1000 (zm <= 100000) and s the sum of squared
-- spreads (limbs): the least r with (1000 r)^2 >= zm^2 s, decided exactly in limbs from a float guess
-- (within 10^-15 of the truth, so at most a step or two off). At most cap (callers pass limit + 1, at
-- most 1e12 + 1: every candidate is refused at cap as at any larger reserve).
local function e_spread_reserve(s, zm, cap)
  if zm <= 0 then return 0 end
  local sf = bn_float(s)
  if sf <= 0 then return 0 end
  local r = math.floor(zm * math.sqrt(sf) / 1000)
  if r > cap + 2 then return cap end
  local t = bn_mul_small(bn_mul_small(s, zm), zm)
  while bn_cmp(bn_sq1e6(r), t) < 0 do r = r + 1 end
  while r > 0 and bn_cmp(bn_sq1e6(r - 1), t) >= 0 do r = r - 1 end
  return math.min(r, cap)
end

-- The linear spread sum saturates here (below 2^53 with the next spread, < 2^41, added): a sum this
-- large makes any risk reserve (k >= 0.001) exceed every limit (1e12) anyway.
local LIN_MAX = 4503599627370496  -- 2^52

-- elastic.risk_reserve: ceil(km lin / 1000), at most cap (as e_spread_reserve), for 0 <= lin <= LIN_MAX:
-- km q + ceil(km rem / 1000) with lin = 1000 q + rem (km q is rounded only above 2^53, far above cap).
local function e_risk_reserve(lin, km, cap)
  if km <= 0 or lin <= 0 then return 0 end
  local q = math.floor(lin / 1000)
  if q * 1000 > lin then q = q - 1 end  -- the division may round up near 2^53
  local a = km * q
  if a > cap then return cap end
  return math.min(cap, a + cdiv(km * (lin - q * 1000), 1000))
end

-- items: list of {h=held, b=bound, m=meta, a=admission seq}. Returns the prepared profile: the
-- distinct lease ends (remaining steps) ascending, with suffix sums of blocks and growers (terms alive
-- at an end are those with remaining >= it). Terms are aggregated per end and the ends sorted as plain
-- numbers (C comparisons), which keeps a pass over a thousand leases cheap.
local function e_profile(items, bs)
  local projs = {}
  local active, active_a = {}, {}
  -- pinned prefixes (elastic._pinned_groups): the pin's term holds the blocks forever; every other lease
  -- with the key is charged without its share (elastic._pin_share), growing or not
  local pinned = {}
  for _, it in ipairs(items) do
    if it.m.pn == 1 and it.m.pk ~= nil then pinned[it.m.pk] = math.max(0, it.m.pb or 0) end
  end
  for i, it in ipairs(items) do
    local blocks, rem, grows = e_project(it.h, it.b, bs, it.m, false)
    projs[i] = {blocks, rem, grows}
    local m = it.m
    -- the Python ledger walks leases in admission order: the last qualifying member's prefix wins
    if m.pk ~= nil and pinned[m.pk] == nil and m.f1 == 1 and (m.pb or 0) > 0 then
      local a = it.a or 0
      if active_a[m.pk] == nil or a >= active_a[m.pk] then active[m.pk], active_a[m.pk] = m.pb, a end
    end
  end
  for i, it in ipairs(items) do
    local k = it.m.pk
    if k ~= nil and active[k] ~= nil and projs[i][3] then active[k] = math.min(active[k], projs[i][1]) end
  end
  local ab, ag, ends = {}, {}, {}
  local function add(blocks, rem, grows)
    if ab[rem] == nil then
      ab[rem], ag[rem] = 0, 0
      ends[#ends + 1] = rem
    end
    ab[rem] = ab[rem] + blocks
    if grows then ag[rem] = ag[rem] + 1 end
  end
  local gend = {}
  for i, it in ipairs(items) do
    local p = projs[i]
    local k = it.m.pk
    if k ~= nil and pinned[k] ~= nil and it.m.pn ~= 1 then
      add(p[1] - math.max(0, math.min(pinned[k], it.m.pb or pinned[k], p[1])), p[2], p[3])
    elseif k ~= nil and active[k] ~= nil and p[3] then
      add(p[1] - active[k], p[2], true)
      if gend[k] == nil or p[2] > gend[k] then gend[k] = p[2] end
    else
      add(p[1], p[2], p[3])
    end
  end
  local groups = {}
  for k, e in pairs(gend) do
    add(active[k], e, false)
    groups[k] = {active[k], e}
  end
  for k, b in pairs(pinned) do groups[k] = {b, FOREVER} end
  table.sort(ends)
  local n = #ends
  local sb, sg, values = {}, {}, {}
  sb[n + 1], sg[n + 1] = 0, 0
  for j = n, 1, -1 do
    local e = ends[j]
    sb[j] = sb[j + 1] + ab[e]
    sg[j] = sg[j + 1] + ag[e]
  end
  local peak = sb[1]
  for j = 1, n do
    values[j] = sb[j] + sg[j] * cdiv(ends[j], bs)
    if values[j] > peak then peak = values[j] end
  end
  local pr = {bs = bs, n = n, ends = ends, sb = sb, sg = sg, values = values, peak = peak, groups = groups,
              empty = #items == 0}
  local res = e_res()
  if res.on then
    -- the reserves' sums over the live leases (ElasticPolicy._spreads), and what fits' fast path reads:
    -- the sum of bounds, the lease count and the sum of excess blocks (e_excess)
    local sq, lin, bsum, xsum = {0}, 0, 0, 0
    for _, it in ipairs(items) do
      local u = e_spread(it.h, it.b, bs, it.m, false)
      if u > 0 then
        bn_add_sq(sq, u)
        lin = math.min(lin + u, LIN_MAX)
      end
      bsum = bsum + it.b
      xsum = xsum + e_excess(it, bs)
    end
    pr.res, pr.sq, pr.lin, pr.bsum, pr.nl, pr.xsum = res, sq, lin, bsum, #items, xsum
  end
  return pr
end

-- _Profile.peak_with, evaluated at every instant (0, each end, the candidate's end): O(n).
local function e_peak_with(pr, cb, cr, cg, xp, xfrom)
  local bs = pr.bs
  local gc = cg and 1 or 0
  local best = pr.sb[1] + cb
  local k = pr.n + 1
  local ends, values = pr.ends, pr.values
  for j = 1, pr.n do
    local e = ends[j]
    local v = values[j]
    if e <= cr then
      v = v + cb + gc * cdiv(e, bs)
      if xp ~= nil and e > xfrom then v = v + xp end
    elseif k > pr.n then
      k = j
    end
    if v > best then best = v end
  end
  if k > pr.n then
    -- no end beyond the candidate's: find the first end >= cr (an end equal to cr is alive there)
    for j = 1, pr.n do
      if ends[j] >= cr then k = j break end
    end
  else
    if k > 1 and ends[k - 1] == cr then k = k - 1 end
  end
  local at_end = pr.sb[k] + pr.sg[k] * cdiv(cr, bs) + cb + gc * cdiv(cr, bs)
  if xp ~= nil then at_end = at_end + xp end
  if at_end > best then best = at_end end
  return best
end

-- ElasticPolicy.fits for a waiter record w (b, h, m).
local function e_fits(pr, limit, w)
  -- below 0 (an urgent reserve larger than the limit) nothing fits, as in Python; the reserves' caps
  -- below (limit + 1) assume a limit >= 0
  if limit < 0 then return false end
  local m = w.mt or {}
  if pr.empty and w.b + e_excess({b = w.b, m = m}, pr.bs) <= limit and (m.pt or 0) <= w.b * pr.bs then
    -- fits' fast path on an empty pool (no rounding block: a lone lease holds at most its cap)
    return true
  end
  local res = pr.res
  if res ~= nil then
    -- With a reserve: fits' fast path first (bounds, which no forecast error can exceed, fit: the
    -- reserve is not kept), then the projected peak against the limit less the reserve with the
    -- candidate's spread (ElasticPolicy.fits, reserve). Without one the fast path is only a shortcut.
    local bs = pr.bs
    local fast = pr.bsum + pr.nl + w.b + 1 + e_excess({b = w.b, m = m}, bs)
    if fast <= limit and (m.pt or 0) <= w.b * bs and fast + pr.xsum <= limit then return true end
    local cap = limit + 1
    local u = e_spread(w.h, w.b, bs, m, true)
    local sq = pr.sq
    if u > 0 then
      sq = bn_copy(sq)
      bn_add_sq(sq, u)
    end
    limit = limit - e_spread_reserve(sq, res.z, cap) - e_risk_reserve(math.min(pr.lin + u, LIN_MAX), res.k, cap)
  end
  local cb, cr, cg = e_project(w.h, w.b, pr.bs, m, true)
  local xp, xfrom = nil, nil
  local g = nil
  if m.pk ~= nil then g = pr.groups[m.pk] end
  if g ~= nil and g[2] >= FOREVER then
    cb = cb - math.max(0, math.min(g[1], m.pb or g[1], cb))  -- a pinned prefix: held by its pin
  elseif g ~= nil and cg then
    local pb = m.pb
    if pb == nil then pb = g[1] end
    pb = math.min(g[1], pb, cb)
    cb = cb - pb
    if cr > g[2] then xp, xfrom = pb, g[2] end
  end
  return e_peak_with(pr, cb, cr, cg, xp, xfrom) <= limit
end

-- ElasticPolicy.urgent_blocks: the blocks kept free of a waiter of priority p for the more urgent classes,
-- ceil(ru / 1000 x the largest bound among the leases in zset `key` (K_UP or a replica's) of priority < p),
-- exact (elastic.urgent_room). One ZREVRANGEBYSCORE per more urgent class live, the URGENT_CLASSES_MAX
-- nearest (elastic.URGENT_CLASSES_MAX). A member whose lease is gone (dropped by a script before :up,
-- which left it there) is removed as it is met, within as many reads again.
local URGENT_CLASSES_MAX = 64
local function e_urgent(key, p, ru)
  if ru <= 0 then return 0 end
  local top, hi, seen = 0, string.format('(%d', p * PRIO_SPAN), 0
  for _ = 1, 2 * URGENT_CLASSES_MAX do
    local r = redis.call('ZREVRANGEBYSCORE', key, hi, '-inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if #r == 0 then break end
    if redis.call('HEXISTS', K_LEASES, r[1]) == 0 then
      redis.call('ZREM', key, r[1])
    else
      local sc = tonumber(r[2])
      local q = math.floor(sc / PRIO_SPAN)
      top = math.max(top, sc - q * PRIO_SPAN)
      hi = string.format('(%d', q * PRIO_SPAN)
      seen = seen + 1
      if seen >= URGENT_CLASSES_MAX then break end
    end
  end
  return top * math.floor(ru / 1000) + cdiv(top * (ru % 1000), 1000)
end

-- Live leases as profile items (nil when there are more than ELASTIC_MAX_LEASES: strict fallback).
local function em_opt(v)
  v = tonumber(v)
  if v < 0 then return nil end
  return v
end

-- False when there are more live leases than the cap: grant passes then admit by the strict rule.
local function e_capped()
  -- meta field 'emax' overrides the cap (operators, and the test of the fallback)
  local cap = tonumber(redis.call('HGET', K_META, 'emax') or ELASTIC_MAX_LEASES)
  return meta_num('nl') > cap
end

-- The leases mirrored in hash `key` (K_EM, or a fleet replica's) as profile items.
local function e_parse(key)
  local vals = redis.call('HVALS', key)
  local items = {}
  for i = 1, #vals do
    local v = vals[i]
    local h, b, a, pt, tk, ft, st, pb, f1, mo, fh, pk =
      string.match(v, '^(%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%-?%d+) (.*)$')
    if h == nil then
      -- written before fh (its pk field, "-", "=..." or "*...", never matches fh's number)
      h, b, a, pt, tk, ft, st, pb, f1, mo, pk =
        string.match(v, '^(%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (.*)$')
      fh = '-1'
    end
    local m = {pt = em_opt(pt), tk = em_opt(tk), ft = em_opt(ft), st = em_opt(st), pb = em_opt(pb),
               f1 = em_opt(f1), mo = em_opt(mo), fh = em_opt(fh)}
    local c = string.sub(pk, 1, 1)
    if c == '=' then m.pk = string.sub(pk, 2) elseif c == '*' then m.pk, m.pn = string.sub(pk, 2), 1 end
    items[i] = {h = tonumber(h), b = tonumber(b), m = m, a = tonumber(a)}
  end
  return items
end

local function e_items()
  if e_capped() then return nil end
  return e_parse(K_EM)
end

-- The projected peak of the live leases (BudgetStatus.used under elastic).
local function e_used()
  local items = e_items()
  if items == nil then return meta_num('bsum') end
  return e_profile(items, meta_num('bs')).peak
end

-- Decode and validate a compact meta object from a caller (never trusted). '' -> {}. With
-- allow_null, a JSON null is kept (it removes the field in merge_meta).
local META_INT = {pt = true, tk = true, ft = true, pb = true, mo = true, fh = true}
local META_FLAG = {st = true, f1 = true}
local function meta_arg(raw, allow_null)
  if raw == nil or raw == '' then return {} end
  local ok, m = pcall(cjson.decode, raw)
  if not ok or type(m) ~= 'table' then
    error({err = 'ERR zp: lease meta must be a JSON object, got ' .. string.sub(tostring(raw), 1, 80)})
  end
  local out = {}
  for k, v in pairs(m) do
    if allow_null and v == cjson.null then
      out[k] = v
    elseif META_INT[k] then
      out[k] = int_arg(v, 'meta ' .. k, 0, 1e12)
    elseif META_FLAG[k] then
      out[k] = int_arg(v, 'meta ' .. k, 0, 1)
    elseif k == 'pk' then
      if type(v) ~= 'string' or string.len(v) > 256 then
        error({err = 'ERR zp: meta pk (prefix key) must be a string of at most 256 characters'})
      end
      out[k] = v
    end  -- unknown fields are dropped: the policy reads none
  end
  return out
end

-- Merge a compact meta update (cjson object; null removes a field) into record field m.
local function merge_meta(rec, upd)
  local m = rec.m or {}
  for k, v in pairs(upd) do
    if v == cjson.null then m[k] = nil else m[k] = v end
  end
  rec.m = m
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

-- Ledger.size_limit: the limit, or the larger size limit a temporary cut kept (set_limit with keep_size).
local function size_limit(limit)
  local s = tonumber(redis.call('HGET', K_META, 'slimit'))
  if s and s > limit then return s end
  return limit
end

-- Ledger.set_limit: a waiter larger than the size limit can never be admitted; fail it ('!id' in its
-- mailbox). Callers pass size_limit(limit).
local function reject_if_too_large(id, w, limit, boxes)
  if w.b > limit then
    drop_waiter(id, w)
    add_box(boxes, w.x, '!' .. id)
    return true
  end
  return false
end

-- The waiter record of a scanned line member {id, m}, read once (nil, and the member dropped, if absent).
local function load_waiter(e)
  if e.w == nil then
    local raw = redis.call('HGET', K_WAIT, e.id)
    if raw then
      e.w = cjson.decode(raw)
    else
      redis.call('ZREM', K_LINE, e.m)  -- defensive: a line entry without its record
    end
  end
  return e.w
end

-- ElasticPolicy.walk over the scanned members (each priority class is contiguous in line order): per
-- class, the waiters that have waited >= lpt first, in line order; then the younger ones by
-- forecast_tokens from the largest (absent: 0), line order among equals. Called only with lpt > 0 and
-- starve > 0 (else the walk is line order); it reads every scanned record, the plain walk lazily. Like
-- every grant pass it sees the first SCAN_MAX members only (the Python ledger walks the whole class).
local function e_walk(members, now, lpt)
  local entries = {}
  for _, e in ipairs(members) do
    if load_waiter(e) then entries[#entries + 1] = e end
  end
  local out, i, n = {}, 1, #entries
  while i <= n do
    local p, j = entries[i].w.p, i
    while j < n and entries[j + 1].w.p == p do j = j + 1 end
    local young = {}
    for k = i, j do
      local w = entries[k].w
      if now - w.s >= lpt then
        out[#out + 1] = entries[k]
      else
        local ft = w.mt and w.mt.ft
        if type(ft) ~= 'number' then ft = 0 end
        young[#young + 1] = {e = entries[k], ft = ft, k = k}
      end
    end
    table.sort(young, function(a, b)
      if a.ft ~= b.ft then return a.ft > b.ft end
      return a.k < b.k
    end)
    for _, y in ipairs(young) do out[#out + 1] = y.e end
    i = j + 1
  end
  return out
end

-- Ledger.slo_walk over the scanned members (each priority class is contiguous in line order): per class,
-- the waiters that have waited >= lb (late-bound) in line order, then the young waiters whose deadline
-- is ahead (d > now), earliest first (ticket order, then arrival, among equal deadlines), then the rest
-- in line order. A class with no young waiter whose deadline is ahead walks as under fifo (e_walk when
-- lpt is on). The deadline-ordered waiters come from :dl (SCAN_MAX at most per pass, over all classes),
-- so one whose class is cut by the line scan is still found; the rest of a class is the scanned part.
local function l_walk(members, now, lb, lpt, starve)
  local entries = {}
  for _, e in ipairs(members) do
    if load_waiter(e) then entries[#entries + 1] = e end
  end
  local t0 = meta_num('t0')
  local out, i, n, left = {}, 1, #entries, SCAN_MAX
  while i <= n do
    local p, j = entries[i].w.p, i
    while j < n and entries[j + 1].w.p == p do j = j + 1 end
    local edf, seen = {}, {}
    if left > 0 then
      local lo = p * PRIO_SPAN + math.min(math.max(now - t0, 0), PRIO_SPAN - 1)
      local got = redis.call('ZRANGEBYSCORE', K_DL, '(' .. string.format('%.0f', lo),
        string.format('%.0f', p * PRIO_SPAN + PRIO_SPAN - 1), 'LIMIT', 0, left)
      left = left - #got
      for _, m in ipairs(got) do
        local e = {id = string.sub(m, 14), m = m}
        local w = load_waiter(e)
        if w and w.d ~= nil and w.d > now and now - w.s < lb then
          edf[#edf + 1] = e
          seen[m] = true
        end
      end
    end
    if #edf == 0 then
      local cls = {}
      for k = i, j do cls[#cls + 1] = entries[k] end
      if lpt > 0 and starve > 0 then cls = e_walk(cls, now, lpt) end
      for _, e in ipairs(cls) do out[#out + 1] = e end
    else
      table.sort(edf, function(a, b)
        if a.w.d ~= b.w.d then return a.w.d < b.w.d end
        if a.w.o ~= b.w.o then return a.w.o < b.w.o end
        return a.m < b.m
      end)
      for k = i, j do
        if now - entries[k].w.s >= lb then out[#out + 1] = entries[k] end
      end
      for _, e in ipairs(edf) do out[#out + 1] = e end
      for k = i, j do
        local e = entries[k]
        if now - e.w.s < lb and not seen[e.m] then out[#out + 1] = e end
      end
    end
    i = j + 1
  end
  return out
end

-- ------------------------------------------------------------------------------------------------
-- fleet mode: one line for a fleet of replicas, a budget per replica under the budget's policy
-- (strict: the replica's sum of bounds; elastic: the projected peak of the replica's own leases),
-- placement with session and prefix affinity (zp_client/fleet/ledger.py's FleetLedger.place). The
-- replicas, their counters, the sessions and the prefix index share the budget's hash tag, so one
-- script sees the line and every replica's budget: placement and admission are one atomic step.
-- The line never stops at a barrier: a waiter that fits nowhere and has waited the starvation bound
-- holds one replica (the one least short of room for it) for the rest of the pass, as FleetLedger does.
-- Meta fields: fleet=1, aff (affinity wait ms), mab (min affinity blocks), cf (consecutive failures
-- that eject), be / me (base / max ejection ms), pxmax (prefix entries, all replicas), smax (sessions),
-- fttl (ms: TTL of the routing keys, refreshed on write).
-- Keys besides K_REPS / K_RSUM: :sess HASH session -> replica id and :sessz ZSET session -> last use ms
-- (bounded by smax, oldest evicted); per replica :px:<rid> ZSET prefix key (hex) -> LRU tick and
-- :pxb:<rid> HASH prefix key -> blocks it adds beyond the next shorter prefix.
local K_SESS, K_SESSZ = PREFIX .. ':sess', PREFIX .. ':sessz'
local EVICT_MAX = 256

local function f_px(rid) return PREFIX .. ':px:' .. rid end
local function f_pxb(rid) return PREFIX .. ':pxb:' .. rid end

local function f_cfg()
  local m = redis.call('HMGET', K_META, 'aff', 'mab', 'cf', 'be', 'me', 'pxmax', 'smax', 'fttl', 'starve')
  return {aff = tonumber(m[1]) or 500, mab = tonumber(m[2]) or 4, cf = tonumber(m[3]) or 5,
          be = tonumber(m[4]) or 30000, me = tonumber(m[5]) or 300000, pxmax = tonumber(m[6]) or 100000,
          smax = tonumber(m[7]) or 100000, ttl = tonumber(m[8]) or 86400000, starve = tonumber(m[9]) or 0}
end

local function f_save(r)
  redis.call('HSET', K_REPS, r.id, cjson.encode({u = r.u, lim = r.lim, cap = r.cap, ej = r.ej, x = r.x,
    le = r.le, dr = r.dr}))
end

-- Drop a replica's prefix index (it left, or came back from an ejection: its cache may be gone).
local function f_forget(rid)
  redis.call('DEL', f_px(rid), f_pxb(rid))
  redis.call('HSET', K_RSUM, 'k' .. rid, 0)
end

-- The line's size limit follows the largest replica still in the fleet (meta field limit).
local function f_relimit()
  local top = 0
  local flat = redis.call('HGETALL', K_REPS)
  for i = 2, #flat, 2 do
    local r = cjson.decode(flat[i])
    if r.dr ~= 1 and r.lim > top then top = r.lim end
  end
  redis.call('HSET', K_META, 'limit', top)
  return top
end

-- Every replica with its counters; a draining one without leases is forgotten, an ejected one whose
-- time is over comes back on trial (passive return). Returns (reps by id, ids sorted).
local function f_load(now)
  local flat = redis.call('HGETALL', K_REPS)
  local sums = redis.call('HGETALL', K_RSUM)
  local s = {}
  for i = 1, #sums, 2 do s[sums[i]] = tonumber(sums[i + 1]) end
  local reps, ids = {}, {}
  local gone = false
  for i = 1, #flat, 2 do
    local rid = flat[i]
    local r = cjson.decode(flat[i + 1])
    r.id = rid
    r.bs = s['b' .. rid] or 0
    r.n = s['n' .. rid] or 0
    if r.dr == 1 and r.n <= 0 then
      redis.call('HDEL', K_REPS, rid)
      redis.call('HDEL', K_RSUM, 'b' .. rid, 'n' .. rid, 'f' .. rid, 'k' .. rid, 'p' .. rid, 'q' .. rid,
        'h' .. rid, 'l' .. rid)
      redis.call('DEL', f_px(rid), f_pxb(rid), K_EM .. ':' .. rid, K_UP .. ':' .. rid)
      gone = true
    else
      if (r.ej or 0) > 0 and r.ej <= now then
        r.ej = 0
        redis.call('HSET', K_RSUM, 'f' .. rid, 0)
        f_forget(rid)
        f_save(r)
      end
      reps[rid] = r
      ids[#ids + 1] = rid
    end
  end
  if gone then f_relimit() end
  -- by URL: equal candidates go to the first replica in URL order (as a Fleet made from sorted URLs)
  table.sort(ids, function(a, b) return reps[a].u < reps[b].u end)
  return reps, ids
end

-- The replicas a request may go to: not draining, not ejected; every non-draining one when all are
-- ejected (panic mode: sending beats failing every request locally).
local function f_available(reps, ids)
  local live, ok = {}, {}
  for _, rid in ipairs(ids) do
    local r = reps[rid]
    if r.dr ~= 1 then
      live[#live + 1] = r
      if (r.ej or 0) == 0 then ok[#ok + 1] = r end
    end
  end
  if #ok > 0 then return ok end
  return live
end

-- The blocks of the longest prefix of keys ({{hex, blocks}, ...} shortest first) in rid's index.
local function f_match(rid, keys)
  local args = {}
  for i, k in ipairs(keys) do args[i] = k[1] end
  local scores = redis.call('ZMSCORE', f_px(rid), unpack(args))
  for i = #keys, 1, -1 do
    if scores[i] then return keys[i][2] end
  end
  return 0
end

-- A replica's elastic view for one pass (nil under strict, or above ELASTIC_MAX_LEASES live leases: the
-- strict rule, as the single budget's fallback): each replica's profile is built when a placement first
-- weighs it and rebuilt after an admission there.
local function f_ectx()
  if redis.call('HGET', K_META, 'policy') ~= 'elastic' or e_capped() then return nil end
  return {bs = meta_num('bs'), items = {}, profs = {}, ru = meta_num('ru')}
end

local function f_prof(ec, rid)
  local p = ec.profs[rid]
  if p == nil then
    if ec.items[rid] == nil then ec.items[rid] = e_parse(K_EM .. ':' .. rid) end
    p = e_profile(ec.items[rid], ec.bs)
    ec.profs[rid] = p
  end
  return p
end

-- The replica's used blocks as its policy counts them: the projected peak, or the sum of bounds.
local function f_used(ec, r)
  if ec == nil then return r.bs end
  return f_prof(ec, r.id).peak
end

local f_fallback_ru = nil  -- f_fits' urgent reserve when it counts bounds (set at its first use in a call)

-- Does the replica's policy admit waiter w now (Ledger.fits_now, with the bound within its limit)?
local function f_fits(ec, r, w)
  if w.b > r.lim then return false end
  if ec == nil then
    -- strict, or elastic's strict fallback above the lease cap (which keeps the urgent room, as grant's);
    -- the room's setting is read once per script call (0 under strict: e_urgent returns at once)
    if f_fallback_ru == nil then
      f_fallback_ru = redis.call('HGET', K_META, 'policy') == 'elastic' and meta_num('ru') or 0
    end
    return r.bs + w.b <= r.lim - e_urgent(K_UP .. ':' .. r.id, w.p or 0, f_fallback_ru)
  end
  return e_fits(f_prof(ec, r.id), r.lim - e_urgent(K_UP .. ':' .. r.id, w.p or 0, ec.ru), w)
end

-- A waiter admitted on replica rid: its profile includes the new lease from now on.
local function f_added(ec, rid, w, adm)
  if ec == nil then return end
  if ec.items[rid] == nil then ec.items[rid] = e_parse(K_EM .. ':' .. rid) end
  local items = ec.items[rid]
  items[#items + 1] = {h = w.h, b = w.b, m = w.mt or {}, a = adm}
  ec.profs[rid] = nil
end

-- FleetLedger.place: among the available replicas whose policy admits the waiter (f_fits), its
-- session's replica first, then the longest prefix match, then the least projected load ((used + bound) /
-- limit). Returns (replica, matched blocks), false when no replica admits it, or nil when it waits (up to
-- aff ms from its arrival) for the replica it prefers while another admits it. `held` (a grant pass's;
-- nil on the fast path) names replicas kept for earlier waiters of the pass: one waiting for its affinity
-- holds the replica it would fall back to, one past the starvation bound that fits nowhere holds the
-- replica least short of room for it; nobody later in the pass takes those.
local function f_place(reps, ids, w, now, cfg, ec, held)
  local avail = f_available(reps, ids)
  if #avail == 0 then return false end
  local rt = w.rt or {}
  if rt.a and #rt.a > 0 then
    -- a moved request avoids the replicas that failed it, while others are available
    local avoid, kept = {}, {}
    for _, rid in ipairs(rt.a) do avoid[rid] = true end
    for _, r in ipairs(avail) do
      if not avoid[r.id] then kept[#kept + 1] = r end
    end
    if #kept > 0 then avail = kept end
  end
  if held ~= nil and next(held) ~= nil then
    local kept = {}
    for _, r in ipairs(avail) do
      if not held[r.id] then kept[#kept + 1] = r end
    end
    if #kept == 0 then return false end
    avail = kept
  end
  local keys = rt.k
  local sess = nil
  if rt.s then sess = redis.call('HGET', K_SESS, rt.s) end
  local best, b1, b2, b3 = nil, 0, 0, 0
  local pref, p1, p2 = nil, 0, 0
  for _, r in ipairs(avail) do
    local m = 0
    if keys and #keys > 0 then m = f_match(r.id, keys) end
    local s1 = (sess ~= nil and r.id == sess) and 1 or 0
    if pref == nil or s1 > p1 or (s1 == p1 and m > p2) then pref, p1, p2 = r, s1, m end
    if f_fits(ec, r, w) then
      local load = 0 - (f_used(ec, r) + w.b) / math.max(1, r.lim)
      if best == nil or s1 > b1 or (s1 == b1 and (m > b2 or (m == b2 and load > b3))) then
        best, b1, b2, b3 = r, s1, m, load
      end
    end
  end
  if best == nil then
    if held ~= nil and now - w.s >= cfg.starve then
      local target, short = nil, nil
      for _, r in ipairs(avail) do
        if w.b <= r.lim then
          local x = f_used(ec, r) + w.b - r.lim
          if short == nil or x < short then target, short = r, x end
        end
      end
      if target ~= nil then held[target.id] = true end
    end
    return false
  end
  -- never past the starvation bound: a waiter that old must not wait for its affinity any longer
  if now - w.s < math.min(cfg.aff, cfg.starve) and pref ~= best
      and (p1 > b1 or p2 - b2 >= math.max(1, cfg.mab)) then
    if held ~= nil then held[best.id] = true end
    return nil  -- worth waiting a little for the replica that has it cached
  end
  return best, b2
end

-- PrefixIndex.insert: the keys touched from the longest to the shortest (the shortest, the shared
-- head, gets the newest tick and is evicted last), then evicted LRU-first down to the replica's cache
-- (blocks) and to pxmax entries over all replicas. Bounded: at most EVICT_MAX evictions per call.
local function f_insert(reps, ids, rid, keys, cfg)
  local zk, bk = f_px(rid), f_pxb(rid)
  if redis.call('EXISTS', zk) == 0 then  -- expired (fttl) or new: its block count starts again
    redis.call('DEL', bk)
    redis.call('HSET', K_RSUM, 'k' .. rid, 0)
  end
  local n = #keys
  local tick = redis.call('HINCRBY', K_META, 'pxt', n)
  local added = 0
  for i = n, 1, -1 do
    local hex, blocks = keys[i][1], keys[i][2]
    local before = 0
    if i > 1 then before = keys[i - 1][2] end
    if redis.call('ZADD', zk, tick - i + 1, hex) == 1 then
      local d = math.max(0, blocks - before)
      redis.call('HSET', bk, hex, d)
      added = added + d
    end
  end
  local kb = redis.call('HINCRBY', K_RSUM, 'k' .. rid, added)
  local total = 0
  for _, other in ipairs(ids) do total = total + redis.call('ZCARD', f_px(other)) end
  local cap = reps[rid].cap or reps[rid].lim
  local freed, pops = 0, 0
  while (kb > cap or total > cfg.pxmax) and pops < EVICT_MAX do
    local p = redis.call('ZPOPMIN', zk)
    if #p == 0 then break end
    local d = tonumber(redis.call('HGET', bk, p[1]) or '0') or 0
    redis.call('HDEL', bk, p[1])
    kb, total, freed, pops = kb - d, total - 1, freed + d, pops + 1
  end
  if freed > 0 then redis.call('HINCRBY', K_RSUM, 'k' .. rid, 0 - freed) end
  if pops > 0 then redis.call('HINCRBY', K_META, 'pxev', pops) end
  redis.call('PEXPIRE', zk, cfg.ttl)
  redis.call('PEXPIRE', bk, cfg.ttl)
end

-- A waiter placed on replica r: the replica's sums and counters, its prefix index, its session.
local function f_admit(reps, ids, r, w, matched, now, cfg)
  r.bs = r.bs + w.b
  r.n = r.n + 1
  redis.call('HINCRBY', K_RSUM, 'b' .. r.id, w.b)
  redis.call('HINCRBY', K_RSUM, 'n' .. r.id, 1)
  redis.call('HINCRBY', K_RSUM, 'p' .. r.id, 1)
  local rt = w.rt or {}
  local keys = rt.k
  if keys and #keys > 0 then
    local last = keys[#keys][2]
    redis.call('HINCRBY', K_RSUM, 'q' .. r.id, math.max(1, last))
    if matched > 0 then redis.call('HINCRBY', K_RSUM, 'h' .. r.id, math.min(matched, last)) end
    f_insert(reps, ids, r.id, keys, cfg)
  end
  if rt.s then
    redis.call('HSET', K_SESS, rt.s, r.id)
    redis.call('ZADD', K_SESSZ, now, rt.s)
    local over = redis.call('ZCARD', K_SESSZ) - cfg.smax
    if over > 0 then
      local old = redis.call('ZPOPMIN', K_SESSZ, math.min(over, EVICT_MAX))
      for i = 1, #old, 2 do redis.call('HDEL', K_SESS, old[i]) end
    end
    redis.call('PEXPIRE', K_SESS, cfg.ttl)
    redis.call('PEXPIRE', K_SESSZ, cfg.ttl)
  end
  redis.call('PEXPIRE', K_REPS, cfg.ttl)
  redis.call('PEXPIRE', K_RSUM, cfg.ttl)
end

-- A waiter's routing argument (acquire.lua ARGV[10] in fleet mode): {"k": [[hex, blocks], ...]
-- shortest prefix first, "s": session, "a": [replica ids a moved request avoids]}; never trusted.
local function f_route_arg(raw)
  if raw == nil or raw == '' then return {} end
  local ok, v = pcall(cjson.decode, raw)
  if not ok or type(v) ~= 'table' then
    error({err = 'ERR zp: fleet routing must be a JSON object, got ' .. string.sub(tostring(raw), 1, 80)})
  end
  local out = {}
  if type(v.k) == 'table' then
    if #v.k > 64 then error({err = 'ERR zp: at most 64 prefix keys'}) end
    local keys = {}
    for i, k in ipairs(v.k) do
      if type(k) ~= 'table' or type(k[1]) ~= 'string' or not string.match(k[1], '^%x+$')
          or string.len(k[1]) > 32 then
        error({err = 'ERR zp: a prefix key is [hex string of at most 32 digits, blocks]'})
      end
      keys[i] = {k[1], int_arg(k[2], 'prefix blocks', 0, 1e12)}
    end
    if #keys > 0 then out.k = keys end
  end
  if v.s ~= nil and v.s ~= cjson.null then
    if type(v.s) ~= 'string' or string.len(v.s) > 256 then
      error({err = 'ERR zp: a session key is a string of at most 256 characters'})
    end
    out.s = v.s
  end
  if type(v.a) == 'table' then
    if #v.a > 16 then error({err = 'ERR zp: at most 16 replicas to avoid'}) end
    local avoid = {}
    for i, rid in ipairs(v.a) do
      if type(rid) ~= 'string' or not string.match(rid, '^%x+$') or string.len(rid) > 40 then
        error({err = 'ERR zp: a replica to avoid is its id (hex)'})
      end
      avoid[i] = rid
    end
    if #avoid > 0 then out.a = avoid end
  end
  return out
end

-- A replica's base URL ('' when unknown).
local function f_url(rid)
  local raw = redis.call('HGET', K_REPS, rid or '')
  if not raw then return '' end
  return cjson.decode(raw).u
end

-- Ledger.grant: walk the line from the head, admit every waiter that fits; a non-fitting waiter that
-- has waited >= the starvation bound is a barrier. Admitted waiters become leases with the same id and
-- are told through their mailbox (except `self_id`, who learns it from the reply). `caller`: the owner
-- (process) making this call, when the script knows it: its own waiters' grants are claimed as they are
-- made (its call is the proof that it lives; claim_lease), only other processes' are pending.
local function grant(now, self_id, caller)
  if redis.call('ZCARD', K_LINE) == 0 then return 0 end  -- nobody waits: one call, not a pass
  if now < meta_num('rec') then return 0 end  -- recovery: live holders re-adopt first
  local limit, bsum = meta_num('limit'), meta_num('bsum')
  local slimit = size_limit(limit)
  local starve = meta_num('starve')
  local policy = redis.call('HGET', K_META, 'policy') or 'strict'
  local members = redis.call('ZRANGE', K_LINE, 0, SCAN_MAX - 1)
  local n = 0
  local boxes = {}
  -- elastic: the live leases (items) and their prepared profile, rebuilt after each admission
  -- (above ELASTIC_MAX_LEASES the pass admits by the strict rule, but the leases stay elastic ones)
  local is_elastic = policy == 'elastic'
  local fleet = redis.call('HGET', K_META, 'fleet') == '1'
  local reps, rids, fcfg, fec, fheld = nil, nil, nil, nil, nil
  if fleet then
    reps, rids = f_load(now)
    fcfg = f_cfg()
    fec = f_ectx()
    fheld = {}
  end
  local elastic, items, prof = false, nil, nil
  if is_elastic and not fleet and #members > 0 then
    items = e_items()
    elastic = items ~= nil
  end
  local pins = nil
  if is_elastic and not fleet then pins = p_load() end
  local bs = elastic and meta_num('bs') or 0
  local ru = is_elastic and not fleet and meta_num('ru') or 0
  -- the walk: line order (records read lazily: a barrier ends the pass early), or longest first
  local walk = {}
  for i, m in ipairs(members) do walk[i] = {id = string.sub(m, 14), m = m} end
  local lpt = is_elastic and meta_num('lpt') or 0
  if redis.call('HGET', K_META, 'line') == 'slo' then  -- a fleet's line too
    walk = l_walk(walk, now, meta_num('lb'), lpt, starve)
  elseif lpt > 0 and starve > 0 and not fleet then
    walk = e_walk(walk, now, lpt)
  end
  for _, e in ipairs(walk) do
    local id, w = e.id, load_waiter(e)
    -- Another process's waiter is granted only while its process heartbeats (its poll refreshes wexp):
    -- a waiter whose heartbeat lapsed belongs to a dead (or stalled) process and leaves the line here,
    -- even beyond reap's REAP_MAX (a live one's next poll finds it gone and enqueues it again, same
    -- ticket). Its grant would only hold blocks until the lease expired unclaimed.
    local wexp = nil
    if w and id ~= self_id then
      wexp = tonumber(redis.call('ZSCORE', K_WEXP, id))
      if wexp ~= nil and wexp <= now then
        drop_waiter(id, w)
        w = nil
      end
    end
    if w then
      local ok, matched
      if reject_if_too_large(id, w, slimit, boxes) then
        ok = nil  -- failed (set_limit normally did this already; kept for waiters beyond its scan)
      elseif fleet then
        ok, matched = f_place(reps, rids, w, now, fcfg, fec, fheld)  -- a replica, false or nil (waits)
      elseif elastic then
        if pins ~= nil and p_holds_back(pins, w, now) then
          ok = false  -- waits for a pinned prefix's keep-warm (pins.py): a barrier like a misfit
        else
          if prof == nil then prof = e_profile(items, bs) end
          ok = e_fits(prof, limit - e_urgent(K_UP, w.p, ru), w)
        end
      elseif pins ~= nil and p_holds_back(pins, w, now) then
        ok = false  -- the strict fallback of a large elastic pass holds back the same waiters
      elseif is_elastic then
        ok = fits(policy, limit - e_urgent(K_UP, w.p, ru), bsum, w)  -- the fallback keeps the urgent room
      else
        ok = fits(policy, limit, bsum, w)
      end
      if ok then
        drop_waiter(id, w)
        local lease = {b = w.b, h = w.h, p = w.p, o = w.o, w = w.w, l = w.l, g = now}
        local item = id
        if fleet then
          lease.r = ok.id
          item = id .. '@' .. ok.id  -- the mailbox names the replica: no second call to learn it
          f_admit(reps, rids, ok, w, matched, now, fcfg)
        end
        if is_elastic then
          lease.m = w.mt
          lease.a = redis.call('HINCRBY', K_META, 'adm', 1)
          if elastic then
            items[#items + 1] = {h = w.h, b = w.b, m = w.mt or {}, a = lease.a}
            prof = nil
          end
          if fleet then f_added(fec, ok.id, w, lease.a) end
        end
        if is_elastic then em_put(id, lease) end  -- before the record: it sets lease.x
        if pins ~= nil then
          p_admitted(lease, pins)
          pins = p_load()  -- its counts moved
        end
        -- A grant to another process that claims its grants is pending until that process claims it
        -- (claim_lease above): reserved for its claim window cw, then back to the pool if unclaimed.
        local lexp = now + w.l
        if id ~= self_id and w.cw ~= nil and w.w ~= caller then
          lease.c = 1
          lexp = now + w.cw
          redis.call('HINCRBY', K_META, 'cn', 1)
          redis.call('HINCRBY', K_META, 'cb', w.b)
        elseif w.cw == nil and wexp ~= nil and w.t ~= nil and w.hb ~= nil then
          -- (a client that does not claim, before the handshake) its expiry counts from the process's
          -- last heartbeat (wexp - t), one heartbeat interval later, not from now: if the process died
          -- after its last heartbeat, the blocks come back by death + hb + lease ttl
          lexp = math.min(lexp, wexp - w.t + w.hb + w.l)
        end
        -- (a grant claimed as it is made, by its own process's call: that call is the proof that the
        -- process lives now, so its TTL runs from now, like a claim's; counting it from the last
        -- heartbeat shortened it by up to the waiter TTL, and a holder whose first renewal was slow
        -- then lost a lease it was using)
        redis.call('HSET', K_LEASES, id, cjson.encode(lease))
        redis.call('ZADD', K_LEXP, lexp, id)
        redis.call('HINCRBY', K_META, 'hsum', w.h)
        redis.call('HINCRBY', K_META, 'nl', 1)
        bsum = redis.call('HINCRBY', K_META, 'bsum', w.b)
        n = n + 1
        -- '+': a grant to a process that claims its grants, claimed as it was made (its own call made
        -- it): that process uses it without a claim (clients before the handshake never get one)
        if id ~= self_id then add_box(boxes, w.x, (w.cw ~= nil and lease.c == nil) and ('+' .. item) or item) end
      elseif ok == false and not fleet and now - w.s >= starve then
        break  -- barrier: capacity drains to this waiter (a fleet holds a replica instead: f_place)
      end
    end
  end
  notify(boxes)
  return n
end
