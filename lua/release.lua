-- release.lua: drop one request's lease from each lease ZSET (the request finished).
--
-- KEYS[i]   lease ZSETs (on Redis Cluster all in one hash slot)
-- ARGV[1]   lease id (the ZSET member check.lua added)
-- "now"     not used: removing a member needs no clock
--
-- Returns an integer: how many of KEYS held the lease (0 when already released or expired:
-- releasing twice is harmless). An emptied ZSET disappears with its last member.

local released = 0
for i = 1, #KEYS do
  released = released + redis.call('ZREM', KEYS[i], ARGV[1])
end
return released
