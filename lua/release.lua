-- release.lua: drop finished requests' leases from their lease ZSETs.
--
-- KEYS[i]   lease ZSETs (on Redis Cluster all in one hash slot)
-- ARGV[i]   the lease id to drop from KEYS[i] (the ZSET member check.lua added): one ARGV per
--           key, so that the releases of several requests go out as one call (the store's
--           batcher merges the releases waiting for a check into one call per slot group)
-- "now"     not used: removing a member needs no clock
--
-- Returns an array of integers, one per key in KEYS order: 1 when KEYS[i] held ARGV[i], 0
-- when it was already released or expired (releasing twice is harmless). An emptied ZSET
-- disappears with its last member.

local out = {}
for i = 1, #KEYS do
  out[i] = redis.call('ZREM', KEYS[i], ARGV[i])
end
return out
