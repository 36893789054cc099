-- swap_value.lua: set (or delete) a plain value only while it still holds what the caller
-- read (compare-and-set): two operators changing the kill switches or the live overrides at
-- the same instant cannot overwrite each other's change; the loser reads again and re-applies
-- its change (extauthz.store.base.update_value).
--
-- KEYS[1]   the value (a STRING)
-- ARGV[1]   "1": the caller read ARGV[2] | "0": the caller read no value (ARGV[2] ignored)
-- ARGV[2]   the value the caller read
-- ARGV[3]   "1": set ARGV[4] | "0": delete the key
-- ARGV[4]   the new value
-- ARGV[5]   its ttl in ms (integer >= 1) | "0": no expiry (the kill switches, kept until cleared)
--
-- No "now": the TTL is relative (PX), so the script reads no clock.
--
-- Returns 1 when the value was replaced, 0 when another writer changed it first.

local current = redis.call('GET', KEYS[1])
if ARGV[1] == '1' then
  if current ~= ARGV[2] then return 0 end
elseif current then
  return 0
end
if ARGV[3] == '1' and ARGV[5] ~= '0' then
  redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[5])
elseif ARGV[3] == '1' then
  redis.call('SET', KEYS[1], ARGV[4])
else
  redis.call('DEL', KEYS[1])
end
return 1
