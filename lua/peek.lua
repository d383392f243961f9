-- peek.lua: read bucket levels without taking anything (for /status and gauges).
--
-- Time is in milliseconds, from the server (TIME), shifted by EPOCH as in
-- acquire.lua; buckets are the same {t, ts} hashes, a missing key is full.
--
-- KEYS[i]       bucket i
-- ARGV[2i - 1]  rate of bucket i, tokens per ms
-- ARGV[2i]      burst of bucket i, tokens
--
-- Returns {level_1, ..., level_n} as strings: tokens in bucket i now
-- (negative while reservations or a vendor block are outstanding).

local EPOCH = 1700000000
local time = redis.call('TIME')
local now = (tonumber(time[1]) - EPOCH) * 1000 + tonumber(time[2]) / 1000

local out = {}
for i = 1, #KEYS do
  local rate, burst = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  local state = redis.call('HMGET', KEYS[i], 't', 'ts')
  local level = burst
  if state[1] then
    level = math.min(burst, tonumber(state[1]) + (now - tonumber(state[2])) * rate)
  end
  out[i] = string.format('%.6f', level)
end
return out
