-- check.lua: evaluate every store-backed limiter of one request atomically; commit iff admitted.
--
-- Semantics (extauthz/store/base.py): every op is evaluated; the request is admitted iff
-- every op with enforce=1 allows; only then is every op that allows committed. A shadow op
-- (enforce=0) that would refuse neither blocks nor is committed.
--
-- The rules MIRROR extauthz/store/algorithms.py exactly (same float operations, same order,
-- same TOKEN_EPSILON; tests/store/test_differential.py compares this script with the embedded
-- store on random timelines, and a test pins TOKEN_EPSILON below to the Python one):
--   refill  tokens = min(burst, t + max(0, now - ts) * rate)      (no state: burst)
--   admits  tokens + TOKEN_EPSILON >= cost
--   take    t = max(0, tokens - cost)
--   sweep   a lease with expiry <= now is gone; lease_admits: limit <= 0 or live < limit
-- Only the raw state is returned: the caller derives remaining, retry-after and reset with
-- extauthz.store.algorithms.op_result, as the embedded store does.
--
-- KEYS[i]       the key of op i, i = 1..#KEYS (on Redis Cluster all in one hash slot)
-- ARGV[1]       now, in seconds (float), from the caller's injected clock; "" = Redis TIME
--               (seconds + microseconds/1e6 of the Redis server: one clock for every replica)
-- ARGV[2]       lease id: the ZSET member added for each committed lease op
-- then 5 ARGV per op i, starting at j = 3 + 5*(i-1):
--   ARGV[j]     "b" token bucket | "l" lease
--   ARGV[j+1]   "1" enforce | "0" shadow
--   bucket:     ARGV[j+2] rate (tokens/s), ARGV[j+3] burst (tokens), ARGV[j+4] cost (tokens)
--   lease:      ARGV[j+2] limit (live leases; 0 = count only, never refuses),
--               ARGV[j+3] lease ttl (s, float), ARGV[j+4] unused
--
-- State (one key per op; a bucket costs GET + SET, a lease ZREMRANGEBYSCORE + ZCARD + ZADD +
-- PEXPIRE, and the call one TIME when no clock is injected):
--   bucket  STRING "<tokens> <ts>": tokens after the last commit and the now of that commit,
--           both "%.17g" (exact for a double), written with one SET ... EX
--           max(1, ceil(2*burst/rate)) s on commit (twice the fill time: a bucket idle that
--           long is full again, so deleting it changes nothing). The key names differ from
--           the old HASH layout's (extauthz.store.keys: rr2 vs rr), so servers of both
--           versions never read each other's keys (a GET on a hash is WRONGTYPE).
--   lease   ZSET member = lease id, score = expiry time (now + ttl, s); members with
--           score <= now are swept (ZREMRANGEBYSCORE -inf now) before counting;
--           PEXPIRE max(1000, ceil(ttl*1000)) ms on commit (the newest lease's lifetime)
--
-- Returns a flat array: {admitted, ok_1, value_1, ..., ok_n, value_n}
--   admitted, ok_i  integers 1/0 (ok_i: op i allows, on its own)
--   value_i         state BEFORE this request's commit, as seen at "now":
--                   bucket: tokens available (refilled to now, at most burst);
--                   lease: live leases (after the sweep);
--                   as a "%.17g" string (Redis truncates Lua numbers in replies to integers).
--   The caller derives the rest from its own op parameters (algorithms.op_result).

local TOKEN_EPSILON = 1e-9

local function fmt(x)
  return string.format('%.17g', x)
end

local now = tonumber(ARGV[1])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local lease_id = ARGV[2]
local n = #KEYS

local ok = {}
local value = {}
local admitted = true
for i = 1, n do
  local j = 3 + 5 * (i - 1)
  local key = KEYS[i]
  if ARGV[j] == 'b' then
    local rate, burst, cost = tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3]), tonumber(ARGV[j + 4])
    local state = redis.call('GET', key)
    local tokens = burst
    if state then
      local t, ts = string.match(state, '^(%S+) (%S+)$')
      tokens = math.min(burst, tonumber(t) + math.max(0, now - tonumber(ts)) * rate)
    end
    ok[i] = tokens + TOKEN_EPSILON >= cost
    value[i] = tokens
  else
    local limit = tonumber(ARGV[j + 2])
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    local count = redis.call('ZCARD', key)
    ok[i] = limit <= 0 or count < limit
    value[i] = count
  end
  if not ok[i] and ARGV[j + 1] == '1' then
    admitted = false
  end
end

local out = {admitted and 1 or 0}
for i = 1, n do
  local j = 3 + 5 * (i - 1)
  local key = KEYS[i]
  if admitted and ok[i] then
    if ARGV[j] == 'b' then
      local rate, burst, cost = tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3]), tonumber(ARGV[j + 4])
      redis.call('SET', key, fmt(math.max(0, value[i] - cost)) .. ' ' .. fmt(now),
                 'EX', math.max(1, math.ceil(2 * burst / rate)))
    else
      local ttl = tonumber(ARGV[j + 3])
      redis.call('ZADD', key, fmt(now + ttl), lease_id)
      redis.call('PEXPIRE', key, math.max(1000, math.ceil(ttl * 1000)))
    end
  end
  out[2 * i] = ok[i] and 1 or 0
  out[2 * i + 1] = fmt(value[i])
end
return out
