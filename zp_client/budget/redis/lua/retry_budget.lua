-- retry_budget.lua: the fleet-wide retry budget (gRPC / Finagle style) of one zp-client budget.
--
-- One job: record answered logical requests (deposits; the policy makes one per answer) and, when
-- asked, grant one retry if
--     retries_in_window + 1 <= ratio * requests_in_window + floor_per_s * window_s
-- over a sliding window made of fixed buckets. Time is Redis TIME, never a client clock, so every
-- host of the fleet agrees on which bucket is current.
--
-- KEYS[1]  hash under the budget's hash tag, e.g. "{zp:<name>}:retry_budget".
--          fields "r:<bucket>" = requests recorded in that bucket, "s:<bucket>" = retries granted.
-- ARGV[1]  deposits: logical requests to add to the current bucket (>= 0)
-- ARGV[2]  spend: 1 to ask for one retry, 0 to only deposit / read
-- ARGV[3]  ratio (float)
-- ARGV[4]  floor_per_s (float)
-- ARGV[5]  window_ms (integer > 0)
-- ARGV[6]  bucket_ms (integer > 0, divides the window into ceil(window_ms / bucket_ms) buckets)
--
-- Returns {granted (0|1), requests_in_window, retries_in_window, allowance as a string}
-- (the allowance is a float; Lua numbers returned to Redis would be truncated to integers).

local key = KEYS[1]
local deposits = tonumber(ARGV[1])
local spend = tonumber(ARGV[2])
local ratio = tonumber(ARGV[3])
local floor_per_s = tonumber(ARGV[4])
local window_ms = tonumber(ARGV[5])
local bucket_ms = tonumber(ARGV[6])

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local current = math.floor(now_ms / bucket_ms)
local nbuckets = math.ceil(window_ms / bucket_ms)
local oldest = current - nbuckets + 1

if deposits > 0 then
  redis.call('HINCRBY', key, 'r:' .. current, deposits)
end

-- The hash holds at most 2 * nbuckets live fields plus the few that just aged out, so reading it
-- whole is cheap; aged-out buckets are deleted here, which keeps it that small.
local flat = redis.call('HGETALL', key)
local requests, retries = 0, 0
local stale = {}
for i = 1, #flat, 2 do
  local field = flat[i]
  local bucket = tonumber(string.sub(field, 3))
  local value = tonumber(flat[i + 1])
  if bucket == nil or bucket < oldest then
    stale[#stale + 1] = field
  elseif string.sub(field, 1, 1) == 'r' then
    requests = requests + value
  else
    retries = retries + value
  end
end
if #stale > 0 then
  redis.call('HDEL', key, unpack(stale))
end

local allowance = ratio * requests + floor_per_s * (window_ms / 1000.0)
local granted = 0
if spend == 1 and retries + 1 <= allowance then
  redis.call('HINCRBY', key, 's:' .. current, 1)
  retries = retries + 1
  granted = 1
end

-- An idle budget disappears on its own one window after its last use.
if redis.call('EXISTS', key) == 1 then
  redis.call('PEXPIRE', key, window_ms + bucket_ms)
end

return {granted, requests, retries, tostring(allowance)}
