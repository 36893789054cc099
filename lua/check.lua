-- check.lua: evaluate every store-backed limiter of one request atomically; commit iff admitted.
-- One call may carry several requests (the store's batcher merges the checks of one batch,
-- per slot group on a cluster): they are decided one after the other, each on its own and
-- atomically, exactly as the same checks sent as separate calls in one pipeline. It also
-- releases leases: a finished request's release is an entry whose ops are all "r" (the
-- releases waiting for a check ride in the same call, ahead of the checks).
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
--   count   count_admits: count + cost <= limit (integers)
--   grant   (batched grants) grant_pool = min(burst, tokens + held); admits: pool +
--           TOKEN_EPSILON >= cost; grant_size = min(want, pool); t = max(0, pool - grant)
--   return  give_back: t = min(burst, tokens + amount); always allows
--   stamp   grant_stamp: a grant or return stores max(now, stored ts), never back in time
--   quota grant  quota_pool = max(0, count - held); admits: pool + cost <= limit;
--           quota_grant_size = max(0, min(want, limit - pool)); count = pool + grant
--   quota return quota_give_back: count = max(0, count - amount), only while the count exists
--   fleet grant  others = live leases not members "<grant>:0 .. have-1" (ZMSCORE);
--           fleet_grant_top: target = max(0, have + want); limit <= 0: target, else
--           max(min(used, have), min(target, limit - others)); fleet_grant_admits: want <= 0
--           or top > min(used, have); members "<grant>:0 .. top-1" renewed or added back
--           (ZADD: a slot in use that expired while its replica stood still is restored),
--           "<grant>:top .. have-1" removed (one command each for the whole grant)
--   slice   (the quota ledger) others = the live slices (expiry > now) of holders other than
--           the op's, summed; the expired ones removed (HDEL); slice_top = max(0, min(want,
--           total - others)); always allows; the holder's slice set to it (0: removed)
-- Only the raw state is returned: the caller derives remaining, retry-after and reset with
-- the op's rule (extauthz.store.algorithms.RULES), as the embedded store does. Each op kind
-- declares its code below and its ARGV order (ARGS) in extauthz/store/base.py; a test
-- (tests/store/test_op_table.py) requires a branch here for every kind.
--
-- KEYS          the keys of every op of every request, in order (on Redis Cluster all in
--               one hash slot): request r's n_r ops take the next n_r keys
-- ARGV[1]       now, in seconds (float), from the caller's injected clock; "" = Redis TIME
--               (seconds + microseconds/1e6 of the Redis server: one clock for every replica),
--               read once per call (not at all for a call of releases only), shared by its
--               requests
-- then per request, starting at j = 2:
--   ARGV[j]     lease id: the ZSET member added for each committed lease op
--   ARGV[j+1]   n, the number of ops of this request
--   then 5 ARGV per op i, starting at a = j + 2 + 5*(i-1):
--   ARGV[a]     "b" token bucket | "l" lease | "q" quota count | "r" release | "g" grant |
--               "u" return (unspent grant) | "c" quota grant | "v" quota return |
--               "f" fleet grant | "s" ledger slice
--   ARGV[a+1]   "1" enforce | "0" shadow (a release: "0")
--   bucket:     ARGV[a+2] rate (tokens/s), ARGV[a+3] burst (tokens), ARGV[a+4] cost (tokens)
--   lease:      ARGV[a+2] limit (live leases; 0 = count only, never refuses),
--               ARGV[a+3] lease ttl (s, float), ARGV[a+4] unused
--   count:      ARGV[a+2] limit (requests per window), ARGV[a+3] cost, ARGV[a+4] ttl (s,
--               integer: the window's end plus a margin, given to a new count)
--   release:    ZREM the entry's lease id from the key (a ZSET of leases); ARGV[a+2..a+4]
--               unused; ok = the key held it (releasing twice is harmless); nothing to commit
--   grant:      ARGV[a+2] rate, ARGV[a+3] burst, ARGV[a+4] "<cost> <want> <held>" (%.17g
--               numbers: the asking request's cost, the grant wanted, the replica's remainder
--               given back with it); the bucket's state and TTL
--   return:     ARGV[a+2] rate, ARGV[a+3] burst, ARGV[a+4] amount (tokens given back); "0"
--   quota grant: ARGV[a+2] limit, ARGV[a+3] "<cost> <want> <held>" (integers), ARGV[a+4]
--               ttl (as count's); the count's state and TTL
--   quota return: ARGV[a+2] amount (units given back); ARGV[a+3..a+4] unused; "0"
--   fleet grant: ARGV[a+2] limit (as lease's), ARGV[a+3] grant ttl (s, float), ARGV[a+4]
--               "<grant> <have> <want> <used>" (the grant's member prefix, its size, the
--               change: > 0 grow by up to want, <= 0 shrink; the slots in use); the lease
--               key's state; the key's PEXPIRE is only ever raised (exact leases on the same
--               key keep theirs)
--   slice:      ARGV[a+2] total (units), ARGV[a+3] slice ttl (s, float), ARGV[a+4]
--               "<holder> <want>" (the holder's name, no space; the units it asks); "0"
--
-- State (one key per op; a bucket costs GET + SET, a lease ZREMRANGEBYSCORE + ZCARD + ZADD +
-- PEXPIRE, a release ZREM, and the call one TIME when no clock is injected; a key met again
-- in the same call is not read, swept, counted or given its TTL again, see below):
--   bucket  STRING "<tokens> <ts>": tokens after the last commit and the now of that commit,
--           both "%.17g" (exact for a double), written with one SET ... EX
--           max(1, ceil(2*burst/rate)) s on commit (twice the fill time: a bucket idle that
--           long is full again, so deleting it changes nothing). The key names differ from
--           the old HASH layout's (extauthz.store.keys: rr2 vs rr), so servers of both
--           versions never read each other's keys (a GET on a hash is WRONGTYPE).
--   count   STRING: the window's count (an integer); the key names the window (its start),
--           so a new window is a new key. Created with SET ... EX ttl on the window's first
--           commit, then INCRBY (the TTL stays): the count expires after its window.
--   lease   ZSET member = lease id, score = expiry time (now + ttl, s); members with
--           score <= now are swept (ZREMRANGEBYSCORE -inf now) before counting;
--           PEXPIRE max(1000, ceil(ttl*1000)) ms on commit (the newest lease's lifetime)
--   slices  HASH field = holder, value "<units> <expiry>" ("%.17g"); a field with expiry <= now
--           is gone; PEXPIRE max(1000, ceil(ttl*1000)) ms, only ever raised, on a commit
--
-- Returns a flat array, per request in order: {admitted, ok_1, value_1, ..., ok_n, value_n}
--   admitted, ok_i  integers 1/0 (ok_i: op i allows, on its own); admitted -1: a command
--                   failed for this request (each value_i is then the error message)
--   value_i         state BEFORE this request's commit, as seen at "now":
--                   bucket, grant, return: tokens available (refilled to now, at most burst);
--                   lease: live leases (after the sweep); fleet grant: live leases not of
--                   the op's grant (after the sweep); slice: the live slices of the
--                   other holders, summed; count, quota grant, quota
--                   return: the window's count;
--                   release: 0;
--                   as a "%.17g" string (Redis truncates Lua numbers in replies to integers).
--   The caller derives the rest from its own op parameters (algorithms.RULES).

local TOKEN_EPSILON = 1e-9

local function fmt(x)
  return string.format('%.17g', x)
end

-- redis.call(cmd, key, [flag,] args...) with args in slices of at most 1,000 (unpack has a
-- limit, 8,000 values): one command per slice, not one per member; the replies summed.
local SLICE = 1000
local function call_sliced(cmd, key, flag, args)
  local n = 0
  for s = 1, #args, SLICE do
    local part = flag and {cmd, key, flag} or {cmd, key}
    for j = s, math.min(#args, s + SLICE - 1) do
      part[#part + 1] = args[j]
    end
    n = n + redis.call(unpack(part))
  end
  return n
end

-- How many of the members "<grant>:0 .. have-1" are live (ZMSCORE, sliced as above).
local function grant_live(key, grant, have)
  local n = 0
  for s = 0, have - 1, SLICE do
    local part = {'ZMSCORE', key}
    for m = s, math.min(have, s + SLICE) - 1 do
      part[#part + 1] = grant .. ':' .. m
    end
    for _, score in ipairs(redis.call(unpack(part))) do
      if score then
        n = n + 1
      end
    end
  end
  return n
end

-- The fleet_grant_top of algorithms.py.
local function fleet_top(limit, others, have, want, used)
  local target = math.max(0, have + want)
  if limit <= 0 then
    return target
  end
  return math.max(math.min(used, have), math.min(target, limit - others))
end

-- Redis TIME is read at the first op that needs "now" (a call of releases only needs none).
local now = tonumber(ARGV[1])

local out = {}

-- Every request of a call reads the same "now" and no other client runs meanwhile, so what
-- one request read or wrote of a key is still true for the next: each key is read (GET;
-- sweep + ZCARD) and given its TTL once per call, and kept up to date here as the
-- requests commit and release. Exact: the same answers as separate calls.
local buckets = {}  -- bucket key -> {tokens, ts} as stored now (false: no state)
local live = {}     -- lease key -> live leases (swept at now)
local expiry = {}   -- lease key -> the PEXPIRE (ms) this call set, while still in force
local counts = {}   -- count key -> the window's count now (false: no key yet)

-- One request: its n ops use KEYS[k + 1 .. k + n] and the ARGV from j on; its answer is
-- appended to res.
local function check(k, j, n, res)
  local lease_id = ARGV[j]
  local ok = {}
  local value = {}
  local admitted = true
  for i = 1, n do
    local a = j + 2 + 5 * (i - 1)
    local key = KEYS[k + i]
    if now == nil and ARGV[a] ~= 'r' then
      local t = redis.call('TIME')
      now = tonumber(t[1]) + tonumber(t[2]) / 1000000
    end
    local kind = ARGV[a]
    if kind == 'b' or kind == 'g' or kind == 'u' then
      local rate, burst = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
      local state = buckets[key]
      if state == nil then
        local stored = redis.call('GET', key)
        state = false
        if stored then
          local t, ts = string.match(stored, '^(%S+) (%S+)$')
          state = {tonumber(t), tonumber(ts)}
        end
        buckets[key] = state
      end
      local tokens = burst
      if state then
        tokens = math.min(burst, state[1] + math.max(0, now - state[2]) * rate)
      end
      if kind == 'u' then
        ok[i] = true  -- a return always allows
      elseif kind == 'g' then  -- "<cost> <want> <held>": admits from the pool
        local cost, _, held = string.match(ARGV[a + 4], '^(%S+) (%S+) (%S+)$')
        local pool = math.min(burst, tokens + tonumber(held))
        ok[i] = pool + TOKEN_EPSILON >= tonumber(cost)
      else
        ok[i] = tokens + TOKEN_EPSILON >= tonumber(ARGV[a + 4])
      end
      value[i] = tokens
    elseif kind == 'q' or kind == 'c' or kind == 'v' then
      local count = counts[key]
      if count == nil then
        local stored = redis.call('GET', key)
        count = stored and tonumber(stored) or false
        counts[key] = count
      end
      value[i] = count or 0
      if kind == 'q' then
        ok[i] = value[i] + tonumber(ARGV[a + 3]) <= tonumber(ARGV[a + 2])
      elseif kind == 'c' then  -- "<cost> <want> <held>": admits from the pool
        local cost, _, held = string.match(ARGV[a + 3], '^(%S+) (%S+) (%S+)$')
        ok[i] = math.max(0, value[i] - tonumber(held)) + tonumber(cost) <= tonumber(ARGV[a + 2])
      else
        ok[i] = true  -- a return always allows
      end
    elseif kind == 'l' or kind == 'f' then
      local limit = tonumber(ARGV[a + 2])
      local count = live[key]
      if count == nil then
        redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
        count = redis.call('ZCARD', key)
        live[key] = count
      end
      if kind == 'f' then  -- fleet_grant_admits: a growth when a slot is free, a renewal always
        local grant, have, want, used = string.match(ARGV[a + 4], '^(%S+) (%S+) (%S+) (%S+)$')
        have, want, used = tonumber(have), tonumber(want), tonumber(used)
        count = count - grant_live(key, grant, have)
        ok[i] = want <= 0 or fleet_top(limit, count, have, want, used) > math.min(used, have)
      else
        ok[i] = limit <= 0 or count < limit
      end
      value[i] = count
    elseif kind == 's' then  -- the ledger's other live slices; the expired ones removed
      local holder = string.match(ARGV[a + 4], '^(%S+) ')
      local stored = redis.call('HGETALL', key)
      local others, gone = 0, {}
      for x = 1, #stored, 2 do
        local units, at = string.match(stored[x + 1], '^(%S+) (%S+)$')
        if tonumber(at) > now then
          if stored[x] ~= holder then
            others = others + tonumber(units)
          end
        else
          gone[#gone + 1] = stored[x]
        end
      end
      call_sliced('HDEL', key, false, gone)
      ok[i] = true  -- a slice always allows: it is at most what is left
      value[i] = others
    else
      ok[i] = redis.call('ZREM', key, lease_id) == 1
      value[i] = 0
      if ok[i] then
        if live[key] then
          live[key] = live[key] - 1  -- swept at now: what it held was live
        end
        expiry[key] = nil  -- the last member gone takes the key and its TTL with it
      end
    end
    if not ok[i] and ARGV[a + 1] == '1' then
      admitted = false
    end
  end

  res[#res + 1] = admitted and 1 or 0
  for i = 1, n do
    local a = j + 2 + 5 * (i - 1)
    local key = KEYS[k + i]
    if admitted and ok[i] then
      local kind = ARGV[a]
      if kind == 'b' or kind == 'g' or kind == 'u' then
        local rate, burst = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
        local left
        local stamp = now
        if kind ~= 'b' and buckets[key] then
          stamp = math.max(now, buckets[key][2])  -- grant_stamp: never back in time
        end
        if kind == 'b' then
          left = math.max(0, value[i] - tonumber(ARGV[a + 4]))
        elseif kind == 'g' then
          local _, want, held = string.match(ARGV[a + 4], '^(%S+) (%S+) (%S+)$')
          local pool = math.min(burst, value[i] + tonumber(held))
          left = math.max(0, pool - math.min(tonumber(want), pool))
        else
          left = math.min(burst, value[i] + tonumber(ARGV[a + 4]))
        end
        redis.call('SET', key, fmt(left) .. ' ' .. fmt(stamp), 'EX', math.max(1, math.ceil(2 * burst / rate)))
        buckets[key] = {left, stamp}
      elseif kind == 'q' then
        local cost = tonumber(ARGV[a + 3])
        if counts[key] then
          redis.call('INCRBY', key, cost)
        else
          redis.call('SET', key, cost, 'EX', tonumber(ARGV[a + 4]))
        end
        counts[key] = value[i] + cost
      elseif kind == 'c' then
        local limit = tonumber(ARGV[a + 2])
        local _, want, held = string.match(ARGV[a + 3], '^(%S+) (%S+) (%S+)$')
        local pool = math.max(0, value[i] - tonumber(held))
        local after = pool + math.max(0, math.min(tonumber(want), limit - pool))
        if counts[key] then
          redis.call('INCRBY', key, after - value[i])  -- the TTL stays
        else
          redis.call('SET', key, after, 'EX', tonumber(ARGV[a + 4]))
        end
        counts[key] = after
      elseif kind == 'v' then
        if counts[key] then  -- a window gone takes nothing back (no key without a TTL)
          local after = math.max(0, value[i] - tonumber(ARGV[a + 2]))
          redis.call('DECRBY', key, value[i] - after)
          counts[key] = after
        end
      elseif kind == 'f' then
        local limit, ttl = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
        local grant, have, want, used = string.match(ARGV[a + 4], '^(%S+) (%S+) (%S+) (%S+)$')
        have, want, used = tonumber(have), tonumber(want), tonumber(used)
        local top = fleet_top(limit, value[i], have, want, used)
        local at = fmt(now + ttl)
        local keep, drop = {}, {}
        for m = 0, top - 1 do  -- renew what is live, add back what expired, add the new slots
          keep[#keep + 1] = at
          keep[#keep + 1] = grant .. ':' .. m
        end
        for m = top, have - 1 do
          drop[#drop + 1] = grant .. ':' .. m
        end
        -- one ZADD and one ZREM for the whole grant (sliced past 500 members)
        live[key] = live[key] + call_sliced('ZADD', key, false, keep)
        live[key] = live[key] - call_sliced('ZREM', key, false, drop)
        local ms = math.max(1000, math.ceil(ttl * 1000))
        if redis.call('PTTL', key) < ms then  -- never shortens the leases' key TTL
          redis.call('PEXPIRE', key, ms)
        end
        expiry[key] = nil
      elseif kind == 's' then
        local total, ttl = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
        local holder, want = string.match(ARGV[a + 4], '^(%S+) (%S+)$')
        local top = math.max(0, math.min(tonumber(want), total - value[i]))  -- slice_top
        if top > 0 then
          redis.call('HSET', key, holder, fmt(top) .. ' ' .. fmt(now + ttl))
          local ms = math.max(1000, math.ceil(ttl * 1000))
          if redis.call('PTTL', key) < ms then  -- never shortens another holder's
            redis.call('PEXPIRE', key, ms)
          end
        else
          redis.call('HDEL', key, holder)
        end
      elseif kind == 'l' then
        local ttl = tonumber(ARGV[a + 3])
        local added = redis.call('ZADD', key, fmt(now + ttl), lease_id)
        if now + ttl <= now then
          live[key] = nil  -- expired at once: the next request sweeps and counts again
          expiry[key] = nil  -- and its sweep may take the key and its TTL with it
        elseif live[key] then
          live[key] = live[key] + added
        end
        local ms = math.max(1000, math.ceil(ttl * 1000))
        if expiry[key] ~= ms then
          redis.call('PEXPIRE', key, ms)
          expiry[key] = ms
        end
      end
    end
    res[#res + 1] = ok[i] and 1 or 0
    res[#res + 1] = fmt(value[i])
  end
end

-- Each request on its own: a command error in one (a key of another type, say) answers
-- that request {-1, 0, message, ...} (the caller raises it for that request alone) and the
-- others of the call go on, as separate calls in a pipeline would. Its evaluation writes
-- nothing but the sweep; its commit runs only once every op was read.
local k, j = 0, 2
while j <= #ARGV do
  local n = tonumber(ARGV[j + 1])
  local res = {}
  local done, err = pcall(check, k, j, n, res)
  if not done then
    local message = type(err) == 'table' and err.err or tostring(err)
    -- A node that cannot take writes fails the whole call, as a top-level error: the
    -- client drops the connection on it (conn.py) and reconnects, e.g. to the new master
    -- behind a DNS name after a failover. Isolating it per request would keep the
    -- connection to a demoted master forever.
    for _, prefix in ipairs({'READONLY', 'MASTERDOWN', 'LOADING'}) do
      if string.sub(message, 1, #prefix) == prefix then
        return redis.error_reply(message)
      end
    end
    res = {-1}
    for _ = 1, n do
      res[#res + 1] = 0
      res[#res + 1] = message
    end
  end
  for _, v in ipairs(res) do
    out[#out + 1] = v
  end
  k, j = k + n, j + 2 + 5 * n
end
return out
