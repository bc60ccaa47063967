-- held.lua: record a batch of leases' current occupancy (Ledger.report_held), clamped to [0, bound].
-- Growth is recorded, never refused. Reports for leases this owner does not hold are ignored.
-- ARGV: owner, then pairs: id, held.   Returns the number of leases updated.
if redis.call('EXISTS', K_META) == 0 then return 0 end
local owner = ARGV[1]
local n = 0
for i = 2, #ARGV, 2 do
  local id = ARGV[i]
  local raw = redis.call('HGET', K_LEASES, id)
  local v = tonumber(ARGV[i + 1])
  if raw and v then
    local l = cjson.decode(raw)
    if l.w == owner then
      v = math.min(math.max(math.floor(v), 0), l.b)
      if v ~= l.h then
        redis.call('HINCRBY', K_META, 'hsum', v - l.h)
        l.h = v
        redis.call('HSET', K_LEASES, id, cjson.encode(l))
      end
      n = n + 1
    end
  end
end
return n
