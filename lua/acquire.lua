-- acquire.lua: take `cost` tokens from every bucket in KEYS, or from none.
--
-- Time is in milliseconds in this script, read from the server (TIME) and
-- shifted by EPOCH so that state stays exact when written with %.3f.
-- A bucket is a hash {t = tokens, ts = ms}: `t` tokens at time `ts`. Tokens
-- refill at `rate` per ms up to `burst`. `t` may be negative (tokens reserved
-- by holds, or drained by vendor feedback) and `ts` may lie in the future (a
-- vendor block: nothing refills before it). A missing key is a full bucket, so
-- every key expires once it would have refilled to `burst`.
--
-- KEYS[i]       bucket i (tenant buckets first, then global)
-- ARGV[1]       cost: tokens to take from every bucket
-- ARGV[2]       max_wait: ms the caller will hold; 0 = grant only if available now
-- ARGV[1 + 2i]  rate of bucket i, tokens per ms
-- ARGV[2 + 2i]  burst of bucket i, tokens
--
-- Returns {granted, wait, binding, level_1, ..., level_n}, numbers as strings:
--   granted  1 = taken from every bucket, 0 = taken from none
--   wait     ms; granted: until the reservation matures (0 = go now);
--            refused: until every bucket could grant without waiting
--   binding  1-based index of the bucket with the longest wait, 0 when none waits
--   level_i  tokens in bucket i now (after the take when granted)

local EPOCH = 1700000000
local time = redis.call('TIME')
local now = (tonumber(time[1]) - EPOCH) * 1000 + tonumber(time[2]) / 1000

local cost = tonumber(ARGV[1])
local max_wait = tonumber(ARGV[2])
local n = #KEYS

local levels = {}
local wait, binding = 0, 0
for i = 1, n do
  local rate, burst = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
  local state = redis.call('HMGET', KEYS[i], 't', 'ts')
  local level = burst
  if state[1] then
    level = math.min(burst, tonumber(state[1]) + (now - tonumber(state[2])) * rate)
  end
  levels[i] = level
  local need = (cost - level) / rate
  if need > wait then
    wait, binding = need, i
  end
end

local granted = 0
if wait <= max_wait then
  granted = 1
  for i = 1, n do
    local rate, burst = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
    local level = levels[i] - cost
    levels[i] = level
    redis.call('HSET', KEYS[i], 't', string.format('%.6f', level), 'ts', string.format('%.3f', now))
    redis.call('PEXPIRE', KEYS[i], math.ceil((burst - level) / rate) + 1000)
  end
end

local out = {tostring(granted), string.format('%.3f', wait), tostring(binding)}
for i = 1, n do
  out[3 + i] = string.format('%.6f', levels[i])
end
return out
