-- peek.lua: one customer's limiter state as check.lua would read it now, changing nothing
-- (`extauthz inspect`, GET /customers/<hash>). Read-only commands only (GET, ZCOUNT, TIME):
-- no sweep, no TTL, no write, so an inspection never moves a counter.
--
-- The rules MIRROR extauthz/store/algorithms.py (the embedded store's MemoryStore.peek
-- calls them; tests/store run the same peeks on both stores):
--   refill  tokens = min(burst, t + max(0, now - ts) * rate)      (no state: burst)
--   lease   live leases: expiry > now (algorithms.lease_live), counted without the sweep
--   count   the window's count (no key: 0)
--
-- KEYS[i]       the key of op i (extauthz.store.keys: a bucket, a quota window's count or a
--               lease ZSET; on Redis Cluster all in one hash slot: one customer's keys share
--               the tag {u:<hash>})
-- ARGV[1]       now, in seconds (float), from the caller's injected clock; "" = Redis TIME
--               (seconds + microseconds/1e6: the clock check.lua reads)
-- then 3 ARGV per op i, starting at a = 2 + 3*(i-1):
--   ARGV[a]     "b" token bucket | "q" quota count | "l" lease ZSET
--   bucket:     ARGV[a+1] rate (tokens/s), ARGV[a+2] burst (tokens)
--   count, lease: ARGV[a+1], ARGV[a+2] unused ("0")
--
-- Returns an array of "%.17g" strings (Redis truncates Lua numbers in replies to integers),
-- one per op in KEYS order: tokens available now (bucket), the window's count (count), live
-- leases (lease).

local function fmt(x)
  return string.format('%.17g', x)
end

local now = tonumber(ARGV[1])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local out = {}
for i = 1, #KEYS do
  local a = 2 + 3 * (i - 1)
  local kind = ARGV[a]
  if kind == 'b' then
    local rate = tonumber(ARGV[a + 1])
    local burst = tonumber(ARGV[a + 2])
    local state = redis.call('GET', KEYS[i])
    local tokens = burst
    if state then
      local t, ts = string.match(state, '^(%S+) (%S+)$')
      tokens = math.min(burst, tonumber(t) + math.max(0, now - tonumber(ts)) * rate)
    end
    out[i] = fmt(tokens)
  elseif kind == 'q' then
    out[i] = fmt(tonumber(redis.call('GET', KEYS[i]) or '0'))
  else
    out[i] = fmt(redis.call('ZCOUNT', KEYS[i], '(' .. fmt(now), '+inf'))
  end
end
return out
