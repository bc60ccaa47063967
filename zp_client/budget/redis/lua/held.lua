-- held.lua: record a batch of leases' current occupancy (Ledger.report_held), clamped to [0, bound], and
-- under elastic their progress metadata (Ledger.update_meta). Growth is recorded, never refused. Reports
-- for leases this owner does not hold are ignored.
-- ARGV: owner, then triples: id, held ('' = unchanged), meta update (compact JSON; '' = none).
-- Under elastic, progress can let waiters in (a first token makes a prefix shared, a stream on schedule
-- projects less than its bound): when anyone waits, a grant pass runs and admitted waiters are told
-- through their mailboxes, as after a release. Returns the number of leases updated.
if redis.call('EXISTS', K_META) == 0 then return 0 end
local owner = ARGV[1]
heard(owner, now_ms())
local elastic = redis.call('HGET', K_META, 'policy') == 'elastic'
local n = 0
local pinned = elastic and redis.call('EXISTS', K_PINS) == 1
for i = 2, #ARGV, 3 do
  local id = ARGV[i]
  local raw = redis.call('HGET', K_LEASES, id)
  if raw then
    local l = cjson.decode(raw)
    if l.w == owner then
      local changed = false
      local v = tonumber(ARGV[i + 1])
      if v then
        v = math.min(math.max(math.floor(v), 0), l.b)
        if v ~= l.h then
          redis.call('HINCRBY', K_META, 'hsum', v - l.h)
          if pinned then redis.call('HINCRBY', K_META, 'chg', v - l.h) end  -- PinBook.grew
          l.h = v
          changed = true
        end
      end
      if elastic and ARGV[i + 2] and ARGV[i + 2] ~= '' then
        local upd = meta_arg(ARGV[i + 2], true)
        merge_meta(l, upd)
        if upd.f1 == 1 and l.pm == 'w' then p_first_token(l) end
        changed = true
      end
      if changed then
        if l.a then em_put(id, l) end  -- before the record: it sets l.x
        redis.call('HSET', K_LEASES, id, cjson.encode(l))
      end
      n = n + 1
    end
  end
end
if elastic and n > 0 and redis.call('ZCARD', K_LINE) > 0 then
  grant(now_ms(), '', owner)
end
return n
