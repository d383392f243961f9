-- feedback.lua: apply a vendor's own answer to its global buckets.
--
-- Time is in milliseconds, from the server (TIME), shifted by EPOCH as in
-- acquire.lua; buckets are the same `t`/`ts` pairs, in their own hash or in the
-- vendor's state hash.
--
-- mode "block" (a vendor 429): nothing is granted until `block` ms from now
-- (or until tokens already reserved have matured, if later); then the bucket
-- refills from empty. Both `t` and `ts` move: zeroing `t` alone would let the
-- next refill credit the whole time since the old `ts` at once.
-- mode "drain" (remaining quota below the low watermark): the bucket drops to
-- empty now and refills normally; reservations (negative levels) are kept.
--
-- KEYS[i]       global bucket i
-- ARGV[1]       mode: "block" | "drain"
-- ARGV[2]       block: ms to block for (ignored by drain)
-- ARGV[3]       channel to PUBLISH the block's length (ms) on; "" = none
-- ARGV[1 + 3i]  rate of bucket i, tokens per ms
-- ARGV[2 + 3i]  burst of bucket i, tokens
-- ARGV[3 + 3i]  field: "" = the bucket is KEYS[i] itself; else its fields' prefix
--               in the hash KEYS[i] (the vendor's state, as in acquire.lua)
--
-- Returns {until, level_1, ..., level_n}, numbers as strings:
--   until    ms from now until the buckets grant again (0 for drain)
--   level_i  tokens in bucket i now, after the change

local EPOCH = 1700000000
local time = redis.call('TIME')
local now = (tonumber(time[1]) - EPOCH) * 1000 + tonumber(time[2]) / 1000

local mode = ARGV[1]
local block = tonumber(ARGV[2])
local channel = ARGV[3]

local out = {'0'}
local longest = 0
for i = 1, #KEYS do
  local rate, burst, field = tonumber(ARGV[1 + 3 * i]), tonumber(ARGV[2 + 3 * i]), ARGV[3 + 3 * i]
  local ft, fts = 't', 'ts'
  if field ~= '' then
    ft, fts = field .. ':t', field .. ':ts'
  end
  local state = redis.call('HMGET', KEYS[i], ft, fts)
  local level = burst
  if state[1] then
    level = math.min(burst, tonumber(state[1]) + (now - tonumber(state[2])) * rate)
  end
  local t, ts = level, now
  if mode == 'block' then
    local matured = now + math.max(0, -level) / rate
    t, ts = 0, math.max(now + block, matured)
    level = t - (ts - now) * rate
    longest = math.max(longest, ts - now)
  elseif level > 0 then
    t, level = 0, 0
  end
  redis.call('HSET', KEYS[i], ft, string.format('%.6f', t), fts, string.format('%.3f', ts))
  local refilled = ts + (burst - t) / rate -- when this bucket reads full again
  if field == '' then
    redis.call('PEXPIRE', KEYS[i], math.ceil(refilled - now) + 1000)
  else
    -- The state hash lives until the last of its buckets is full again (acquire.lua's `horizon`).
    local horizon = tonumber(redis.call('HGET', KEYS[i], 'horizon') or '0')
    if refilled > horizon then
      horizon = refilled
      redis.call('HSET', KEYS[i], 'horizon', string.format('%.3f', horizon))
    end
    redis.call('PEXPIRE', KEYS[i], math.max(redis.call('PTTL', KEYS[i]), math.ceil(horizon - now) + 1000))
  end
  out[1 + i] = string.format('%.6f', level)
end
out[1] = string.format('%.3f', longest)
if mode == 'block' and channel ~= '' then
  redis.call('PUBLISH', channel, out[1])
end
return out
