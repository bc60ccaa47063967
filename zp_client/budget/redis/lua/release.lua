-- release.lua: return a lease's blocks (Ledger.release) or take a waiter out of line (Ledger.cancel),
-- then run a grant pass; grants are pushed to the admitted waiters' mailboxes. Idempotent: an unknown id
-- is a no-op. Only the owner that holds the lease (or the waiter) may release it.
-- ARGV: id, owner, ok (fleet mode: '1' when the request on the lease succeeded, which ends its
-- replica's run of consecutive failures: success reports ride on the release), f1 ('1': the lease saw
-- its first token, which a batched report may not have told yet; a pinned prefix's member then counts as
-- having touched the prefix).  Returns 1 released a lease | 2 cancelled a waiter | 0 nothing to do.
if redis.call('EXISTS', K_META) == 0 then return 0 end
local id, owner = ARGV[1], ARGV[2]
local now = now_ms()
local done = 0
local raw = redis.call('HGET', K_LEASES, id)
if raw then
  if cjson.decode(raw).w ~= owner then
    error({err = 'ERR zp: lease ' .. id .. ' is not held by this caller; not released'})
  end
  if ARGV[4] == '1' then
    local rec = cjson.decode(raw)
    if rec.pm == 'w' then
      p_first_token(rec)
      raw = cjson.encode(rec)
    end
  end
  local l = drop_lease(id, raw)
  if l and l.r and ARGV[3] == '1' then redis.call('HSET', K_RSUM, 'f' .. l.r, 0) end
  done = 1
else
  local wraw = redis.call('HGET', K_WAIT, id)
  if wraw then
    local w = cjson.decode(wraw)
    if w.w ~= owner then
      error({err = 'ERR zp: waiter ' .. id .. ' belongs to another caller; not cancelled'})
    end
    drop_waiter(id, w)
    done = 2
  end
end
heard(owner, now)
reap(now)
grant(now, '', owner)
return done
