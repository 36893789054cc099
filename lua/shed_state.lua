-- shed_state.lua: the shared worker-utilization shed controller's state: read it, or replace
-- it only if it is still the state the new one was computed from (compare-and-set).
--
-- The controller itself is NOT here: it runs in Python (extauthz.store.algorithms.shed_advance,
-- the same code as the embedded store's). The caller reads {level, last, now}, computes the
-- new level, and swaps it in; when another replica swapped first, the reply carries that
-- replica's state and the caller recomputes from it, so the fleet moves at one controller's
-- pace whoever samples.
--
-- KEYS[1]   the controller HASH {level, last}: level (float), last = "now" of the sample that
--           set it (s); both stored as the caller sent them (repr of a Python float)
-- ARGV[1]   now, in seconds (float), from the caller's injected clock; "" = Redis TIME
--           (seconds + microseconds/1e6 of the Redis server: one clock for every replica)
-- ARGV[2]   "get": read only (no other ARGV) | "set": compare-and-set, with
--   ARGV[3] ARGV[4]   expected level and last, exactly as read ("" "" = no state yet)
--   ARGV[5] ARGV[6]   new level and new last (the "now" the new level was computed for)
--   ARGV[7]           ttl of the HASH (s, float): PEXPIRE max(1000, ceil(ttl*1000)) ms on set
--
-- Returns {swapped, level, last, now}:
--   swapped   integer 1 when "set" replaced the state, else 0
--   level, last   the state held after the call, as stored ("" "" = none)
--   now       the "now" above, as a "%.17g" string (Redis truncates Lua numbers to integers)

local now = tonumber(ARGV[1])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local state = redis.call('HMGET', KEYS[1], 'level', 'last')
local level, last = state[1] or '', state[2] or ''
local swapped = 0
if ARGV[2] == 'set' and level == ARGV[3] and last == ARGV[4] then
  level, last = ARGV[5], ARGV[6]
  redis.call('HSET', KEYS[1], 'level', level, 'last', last)
  redis.call('PEXPIRE', KEYS[1], math.max(1000, math.ceil(tonumber(ARGV[7]) * 1000)))
  swapped = 1
end
return {swapped, level, last, string.format('%.17g', now)}
