-- inflight.lua: live leases in each lease set now (acquire.lua), for /status and
-- the ratelimit_inflight gauge. Expired leases (a replica that died) are dropped.
--
-- KEYS[j]   lease set j
-- Returns {inflight_1, ..., inflight_m}.

local EPOCH = 1700000000
local time = redis.call('TIME')
local now = (tonumber(time[1]) - EPOCH) * 1000 + tonumber(time[2]) / 1000

local out = {}
for j = 1, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[j], '-inf', string.format('%.3f', now))
  out[j] = tostring(redis.call('ZCARD', KEYS[j]))
end
return out
