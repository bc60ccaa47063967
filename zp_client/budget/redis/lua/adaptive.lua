-- adaptive.lua: the adaptive limit's leader lease and its shared state (zp_client/adaptive.py). One
-- controller per budget polls the server: the one holding the leader lease.
-- Keys (derived from the prefix, same hash tag as the budget):
--   <prefix>:adaptive:leader  STRING  the leader's controller id, PX = the leader lease's TTL
--   <prefix>:adaptive         HASH    the leader's state (calibrated limit, last change...), for status
-- ARGV: op, controller id, ttl ms, overloads (429/503/529 answers this process saw since its last call),
-- then field/value pairs to write into the state hash (a value '@now' is replaced by Redis's clock, ms;
-- every write also sets updated_ms).
--   'lead':   renew the lease when ours (PEXPIRE), else take it when free (SET NX PX); on success write
--             the pairs (and leader / leader_since_ms when taken) and take the fleet's pending overloads
--             -> {1, ttl ms, taken 0|1, overloads (the fleet's pending plus ours), state's preemptions
--                 counter or '', state's calibrated limit or '', ms since the last decrease or ''}
--             A follower's overloads are added to the state's pending count for the leader:
--             -> {0, holder's PTTL ms, holder id}
--   'note':   write the pairs while we hold the lease -> {1} | {0}
--   'resign': drop the lease when ours -> {1} | {0}
local K_LEADER = PREFIX .. ':adaptive:leader'
local K_STATE = PREFIX .. ':adaptive'
local STATE_TTL_MS = 86400000  -- the state outlives its leader by a day, then goes
local op, id = ARGV[1], ARGV[2]

local function write_pairs(extra)
  local now = now_ms()
  local args = {'updated_ms', now}
  for i = 5, #ARGV, 2 do
    args[#args + 1] = ARGV[i]
    args[#args + 1] = ARGV[i + 1] == '@now' and now or ARGV[i + 1]
  end
  for _, v in ipairs(extra) do args[#args + 1] = v end
  redis.call('HSET', K_STATE, unpack(args))
  redis.call('PEXPIRE', K_STATE, STATE_TTL_MS)
end

local cur = redis.call('GET', K_LEADER)
if op == 'lead' then
  local ttl = int_arg(ARGV[3], 'ttl', 1, 1e9)
  local own = int_arg(ARGV[4], 'overloads', 0, 1e12)
  local taken = 0
  if cur == id then
    redis.call('PEXPIRE', K_LEADER, ttl)
  elseif redis.call('SET', K_LEADER, id, 'NX', 'PX', ttl) then
    taken = 1
  else
    if own > 0 then
      redis.call('HINCRBY', K_STATE, 'pending_overloads', own)
      redis.call('PEXPIRE', K_STATE, STATE_TTL_MS)
    end
    return {0, redis.call('PTTL', K_LEADER), cur}
  end
  local got = redis.call('HMGET', K_STATE, 'pending_overloads', 'preemptions', 'calibrated',
                         'last_decrease_ms')
  redis.call('HDEL', K_STATE, 'pending_overloads')
  local extra = {}
  if taken == 1 then extra = {'leader', id, 'leader_since_ms', now_ms()} end
  write_pairs(extra)
  local since = ''
  if tonumber(got[4]) then since = math.max(0, now_ms() - tonumber(got[4])) end
  return {1, ttl, taken, (tonumber(got[1]) or 0) + own, got[2] or '', got[3] or '', since}
elseif op == 'note' then
  if cur ~= id then return {0} end
  write_pairs({})
  return {1}
elseif op == 'resign' then
  if cur ~= id then return {0} end
  redis.call('DEL', K_LEADER)
  return {1}
end
return redis.error_reply('adaptive.lua: unknown op ' .. tostring(op))
