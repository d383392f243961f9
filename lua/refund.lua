-- refund.lua: give back the tokens of a hold that never went out; settle a metered request.
--
-- A held request's tokens were taken when it was granted (a reservation: the
-- level went below zero). If the worker goes away before the reservation
-- matures, nothing is sent: without a refund, 50 workers that gave up leave the
-- bucket 50 tokens short and the next worker waits for tokens nobody used.
-- The refund puts `cost` back, never more than was taken (the caller refunds
-- only what its own grant took, once) and never above `burst`. Same `t`/`ts`
-- pairs and time as acquire.lua; the level is written at `now` on the same
-- line it followed, so a vendor block (`ts` in the future) keeps its effect.
--
-- Settling (SPEC §14): a metered request took its estimate; the vendor's answer says
-- what it really cost. Each bucket gets its difference back (never above `burst`), or
-- owes it (a negative amount: the level goes down, below zero if need be, and later
-- requests wait it out; a missing bucket, full, owes it from its burst).
--
-- KEYS[i]       bucket i
-- ARGV[1]       cost: tokens to give back to every bucket; or "|<a_1>,...,<a_n>": a_i to
--               bucket i (negative: a debt), then "|<since>" (ms since the request took its
--               tokens): a refund is no more than the bucket's history allows (its `z` and
--               `zh`, acquire.lua "Late slots": tokens not spent would have overflowed a
--               bucket that stood above empty since; half its burst at most, none above half)
-- ARGV[3i - 1]  rate of bucket i, tokens per ms
-- ARGV[3i]      burst of bucket i, tokens
-- ARGV[3i + 1]  field: "" = the bucket is KEYS[i] itself; else its fields' prefix
--               in the hash KEYS[i] (the vendor's state, as in acquire.lua)
--
-- Returns {level_1, ..., level_n} as strings: tokens in bucket i after the refund.
-- A bucket that is missing (full, or lost with the store's state) is left alone.

local EPOCH = 1700000000
local time = redis.call('TIME')
local now = (tonumber(time[1]) - EPOCH) * 1000 + tonumber(time[2]) / 1000

local amounts = {}
local since = nil
local cost = tonumber(ARGV[1])
if cost then
  for i = 1, #KEYS do
    amounts[i] = cost
  end
else
  local list, ago = string.match(ARGV[1], '^|([^|]*)|?([^|]*)$')
  for x in string.gmatch(list, '[^,]+') do
    amounts[#amounts + 1] = tonumber(x)
  end
  if ago ~= '' then
    since = now - tonumber(ago) + 0.001
  end
end
local out = {}
for i = 1, #KEYS do
  local amount = amounts[i]
  local rate, burst, field = tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i]), ARGV[3 * i + 1]
  local ft, fts = 't', 'ts'
  if field ~= '' then
    ft, fts = field .. ':t', field .. ':ts'
  end
  local p = ft:sub(1, -2)
  local state = redis.call('HMGET', KEYS[i], ft, fts, p .. 'lr', p .. 'lb', p .. 'lu', p .. 'z', p .. 'zh')
  if state[5] and tonumber(state[5]) > now then -- a learned limit (acquire.lua)
    rate, burst = math.min(rate, tonumber(state[3])), math.min(burst, tonumber(state[4]))
  end
  local level = burst
  if state[1] or amount < 0 then
    if state[1] then
      level = math.min(burst, tonumber(state[1]) + (now - tonumber(state[2])) * rate)
    end
    if amount > 0 and since then
      local room = burst - math.max(level, 0)
      if not state[7] or tonumber(state[7]) >= since then
        room = 0
      elseif not state[6] or tonumber(state[6]) >= since then
        room = math.min(room, burst / 2)
      end
      amount = math.min(amount, room)
    end
    level = math.min(burst, level + amount)
    redis.call('HSET', KEYS[i], ft, string.format('%.6f', level), fts, string.format('%.3f', now))
    local life = math.ceil((burst - level) / rate) + 1000
    if field == '' then
      redis.call('PEXPIRE', KEYS[i], life)
    elseif amount < 0 then -- the state hash: it outlives the debt
      local ttl = redis.call('PTTL', KEYS[i])
      if ttl >= 0 and ttl < life then
        redis.call('PEXPIRE', KEYS[i], life)
      end
    end
  end
  out[i] = string.format('%.6f', level)
end
return out
