-- release.lua: give back requests' leases (acquire.lua), and say so.
--
-- Called when the vendor's answer has been relayed, the exchange failed, the
-- worker went away, or a hold was cancelled: whichever comes first, once; the
-- releases of one replica's loop turn on the same sets come together. The
-- announcement on `channel` wakes requests held for a free slot on every
-- replica (they are woken, not polling). Only sets that were full before and
-- have room now are announced: a request waits for a slot only after finding
-- its set full, so a set below its cap has nobody to wake (and at most caps,
-- most releases announce nothing: no message to every replica per request).
--
-- KEYS[j]        lease set j (m sets)
-- ARGV[1]        channel to PUBLISH the names of the sets that gained room on; "" = none
-- ARGV[1+j]      cap of set j
-- ARGV[m+2 ...]  the lease ids given back (at least one)
--
-- Returns {inflight_1, ..., inflight_m}: live leases in each set after the release.

local EPOCH = 1700000000
local time = redis.call('TIME')
local now = (tonumber(time[1]) - EPOCH) * 1000 + tonumber(time[2]) / 1000

local ids = {}
for i = #KEYS + 2, #ARGV do
  ids[#ids + 1] = ARGV[i]
end

local out = {}
local released = {}
for j = 1, #KEYS do
  local cap = tonumber(ARGV[1 + j])
  local before = redis.call('ZCARD', KEYS[j])
  local after = before - redis.call('ZREM', KEYS[j], unpack(ids))
  if after > 0 then
    after = after - redis.call('ZREMRANGEBYSCORE', KEYS[j], '-inf', now)
  end
  if before >= cap and after < cap then
    released[#released + 1] = KEYS[j]
  end
  out[j] = tostring(after)
end
if ARGV[1] ~= '' and #released > 0 then
  redis.call('PUBLISH', ARGV[1], table.concat(released, ' '))
end
return out
