-- inflight.lua: live (unexpired) leases per lease ZSET.
--
-- KEYS[i]   lease ZSETs (member = lease id, score = expiry time in s; see check.lua)
--           (on Redis Cluster all in one hash slot)
-- ARGV[1]   now, in seconds (float), from the caller's injected clock; "" = Redis TIME
--
-- Sweeps expired leases (score <= now: extauthz.store.algorithms.lease_live, as check.lua)
-- from each key, then counts.
-- Returns an array of integers: live leases per key, in KEYS order.

local now = tonumber(ARGV[1])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local out = {}
for i = 1, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  out[i] = redis.call('ZCARD', KEYS[i])
end
return out
