-- peek.lua: read bucket levels without taking anything (for /status and gauges).
--
-- Time is in milliseconds, from the server (TIME), shifted by EPOCH as in
-- acquire.lua; buckets are the same `t`/`ts` pairs, a missing bucket is full.
--
-- KEYS[i]       bucket i
-- ARGV[3i - 2]  rate of bucket i, tokens per ms
-- ARGV[3i - 1]  burst of bucket i, tokens
-- ARGV[3i]      field: "" = the bucket is KEYS[i] itself; else its fields' prefix
--               in the hash KEYS[i] (the vendor's state, as in acquire.lua)
--
-- Returns {level_1, ..., level_n} as strings: tokens in bucket i now
-- (negative while reservations or a vendor block are outstanding).

local EPOCH = 1700000000
local time = redis.call('TIME')
local now = (tonumber(time[1]) - EPOCH) * 1000 + tonumber(time[2]) / 1000

local out = {}
for i = 1, #KEYS do
  local rate, burst, field = tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1]), ARGV[3 * i]
  local ft, fts = 't', 'ts'
  if field ~= '' then
    ft, fts = field .. ':t', field .. ':ts'
  end
  local state = redis.call('HMGET', KEYS[i], ft, fts, ft:sub(1, -2) .. 'lr', ft:sub(1, -2) .. 'lb', ft:sub(1, -2) .. 'lu')
  if state[5] and tonumber(state[5]) > now then -- a learned limit (acquire.lua)
    rate, burst = math.min(rate, tonumber(state[3])), math.min(burst, tonumber(state[4]))
  end
  local level = burst
  if state[1] then
    level = math.min(burst, tonumber(state[1]) + (now - tonumber(state[2])) * rate)
  end
  out[i] = string.format('%.6f', level)
end
return out
