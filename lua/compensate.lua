-- compensate.lua: give back what check.lua committed for a request that was refused
-- elsewhere (Redis Cluster: another hash-slot group refused it, or failed).
--
-- KEYS[i]   keys of the ops that check.lua committed in this group (one hash slot)
-- ARGV[1]   lease id the lease ops were committed with
-- then 3 ARGV per op i, starting at j = 2 + 3*(i-1):
--   ARGV[j]     "b" token bucket | "l" lease | "q" quota count
--   bucket:     ARGV[j+1] burst (tokens), ARGV[j+2] cost (tokens)
--   count:      ARGV[j+1] cost (DECRBY; the key's TTL stays), ARGV[j+2] unused
--   lease:      ARGV[j+1], ARGV[j+2] unused
-- "now"     not used: a refund adds the cost to the stored token count and keeps the stored
--           timestamp (refill later is computed from it as usual), capped at burst; the
--           key's TTL is kept (SET ... KEEPTTL). Bucket state: check.lua's STRING
--           "<tokens> <ts>". (check.lua took max(0, tokens - cost): a refund of a request
--           admitted within TOKEN_EPSILON gives back at most that epsilon more than it took.)
--
-- Returns an integer: how many ops were given back (a bucket or lease gone already, e.g.
-- expired, is skipped).

local function fmt(x)
  return string.format('%.17g', x)
end

local done = 0
for i = 1, #KEYS do
  local j = 2 + 3 * (i - 1)
  local key = KEYS[i]
  if ARGV[j] == 'b' then
    local state = redis.call('GET', key)
    if state then
      local tokens, ts = string.match(state, '^(%S+) (%S+)$')
      local burst, cost = tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2])
      redis.call('SET', key, fmt(math.min(burst, tonumber(tokens) + cost)) .. ' ' .. ts, 'KEEPTTL')
      done = done + 1
    end
  elseif ARGV[j] == 'q' then
    if redis.call('EXISTS', key) == 1 then
      redis.call('DECRBY', key, tonumber(ARGV[j + 1]))
      done = done + 1
    end
  else
    done = done + redis.call('ZREM', key, ARGV[1])
  end
end
return done
