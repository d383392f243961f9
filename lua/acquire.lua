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
-- Deferral queue. Refused callers are told when to retry. Told all the same
-- moment (when the binding bucket next holds `cost`), precise retriers come back
-- together and all but one are refused again: a herd. So a refusal is given the
-- next free slot of its bucket set's queue instead: the queue key holds the time
-- (same clock) of the first slot no refused caller has been pointed at yet; each
-- refusal takes one slot, `cost / rate` of the binding bucket long. The queue is a
-- schedule of hints, not a reservation: nothing is taken from any bucket, and a
-- caller that never comes back costs the others nothing but a later hint. It is
-- kept per bucket set (per tenant), so a tenant that floods only pushes its own
-- callers' hints out.
--
-- KEYS[i]       bucket i, i = 1..n (tenant buckets first, then global)
-- KEYS[n + 1]   optional: the deferral queue of this bucket set; absent = no queue
--               (the hint is then the wait)
-- ARGV[1]       cost: tokens to take from every bucket
-- ARGV[2]       max_wait: ms the caller will hold; 0 = grant only if available now
-- ARGV[1 + 2i]  rate of bucket i, tokens per ms
-- ARGV[2 + 2i]  burst of bucket i, tokens
--
-- Returns {granted, wait, binding, hint, level_1, ..., level_n}, numbers as strings:
--   granted  1 = taken from every bucket, 0 = taken from none
--   wait     ms; granted: until the reservation matures (0 = go now);
--            refused: until every bucket could grant without waiting
--   binding  1-based index of the bucket with the longest wait, 0 when none waits
--   hint     ms; refused: when to retry, >= wait (the queue slot); granted: = wait
--   level_i  tokens in bucket i now (after the take when granted)

local EPOCH = 1700000000
local time = redis.call('TIME')
local now = (tonumber(time[1]) - EPOCH) * 1000 + tonumber(time[2]) / 1000

local cost = tonumber(ARGV[1])
local max_wait = tonumber(ARGV[2])
local n = (#ARGV - 2) / 2

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
local hint = wait
if wait <= max_wait then
  granted = 1
  for i = 1, n do
    local rate, burst = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
    local level = levels[i] - cost
    levels[i] = level
    redis.call('HSET', KEYS[i], 't', string.format('%.6f', level), 'ts', string.format('%.3f', now))
    redis.call('PEXPIRE', KEYS[i], math.ceil((burst - level) / rate) + 1000)
  end
elseif #KEYS > n then
  local queue = KEYS[n + 1]
  local tail = tonumber(redis.call('GET', queue) or '0') - now
  if tail > hint then
    hint = tail
  end
  local step = cost / tonumber(ARGV[1 + 2 * binding])
  redis.call('SET', queue, string.format('%.3f', now + hint + step), 'PX', math.ceil(hint + step) + 1000)
end

local out = {tostring(granted), string.format('%.3f', wait), tostring(binding), string.format('%.3f', hint)}
for i = 1, n do
  out[4 + i] = string.format('%.6f', levels[i])
end
return out
