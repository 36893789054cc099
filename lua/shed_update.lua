-- shed_update.lua: advance the shared worker-utilization shed controller by one sample.
--
-- The controller is extauthz.shed.advance (same float operations, same order):
--   resting = -delay_before_shedding / time_to_shed_all
--   a new controller starts at rest; otherwise
--   elapsed = clamp(now - last, 0, delay_before_shedding)
--   level   = clamp(level + elapsed * derivative(utilization), resting, 1)
--   derivative: below good_below: utilization/good_below - 1; between good_below and
--   bad_above: 0; above: (utilization - bad_above)/(1 - bad_above); clamped to [-1, 1],
--   divided by time_to_shed_all (level per second).
--
-- KEYS[1]   the controller HASH {level, last} (level: float; last: now of the last sample, s)
-- ARGV[1]   now, in seconds (float), from the caller's injected clock; "" = Redis TIME
-- ARGV[2]   utilization sample (0..1)
-- ARGV[3]   good_below   ARGV[4] bad_above   (utilization fractions)
-- ARGV[5]   delay_before_shedding (s)        ARGV[6] time_to_shed_all (s)
-- ARGV[7]   ttl of the HASH (s, float): PEXPIRE max(1000, ceil(ttl*1000)) ms on every update
--
-- Returns the new level as a "%.17g" string (Redis truncates Lua numbers to integers).

local function fmt(x)
  return string.format('%.17g', x)
end

local function clamp(x, low, high)
  if x < low then return low end
  if x > high then return high end
  return x
end

local now = tonumber(ARGV[1])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local u = tonumber(ARGV[2])
local good, bad = tonumber(ARGV[3]), tonumber(ARGV[4])
local delay, shed_all = tonumber(ARGV[5]), tonumber(ARGV[6])
local ttl = tonumber(ARGV[7])
local resting = -delay / shed_all

local state = redis.call('HMGET', KEYS[1], 'level', 'last')
local level
if state[1] and state[2] then
  local amount
  if u < good then
    amount = u / good - 1.0
  elseif u < bad then
    amount = 0.0
  else
    amount = (u - bad) / (1.0 - bad)
  end
  local derivative = clamp(amount, -1.0, 1.0) / shed_all
  local elapsed = clamp(now - tonumber(state[2]), 0.0, delay)
  level = clamp(tonumber(state[1]) + elapsed * derivative, resting, 1.0)
else
  level = resting
end
redis.call('HSET', KEYS[1], 'level', fmt(level), 'last', fmt(now))
redis.call('PEXPIRE', KEYS[1], math.max(1000, math.ceil(ttl * 1000)))
return fmt(level)
