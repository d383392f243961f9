-- feedback.lua: apply a vendor's own answer to its global buckets.
--
-- Time is in milliseconds, from the server (TIME), shifted by EPOCH as in
-- acquire.lua; buckets are the same `t`/`ts` pairs, in their own hash or in the
-- vendor's state hash, refilling at the lower of the policy's and the learned
-- rate and burst (acquire.lua, "Learned limits").
--
-- mode "block" (a vendor 429): nothing is granted until `block` ms from now
-- (or until tokens already reserved have matured, if later); then the bucket
-- refills from empty. Its field `bk` says when it was blocked: slots kept for
-- deferred callers before then are void (acquire.lua). Both `t` and `ts` move: zeroing `t` alone would let the
-- next refill credit the whole time since the old `ts` at once.
-- mode "drain" (remaining quota below the low watermark): the bucket drops to
-- empty now and refills normally; reservations (negative levels) are kept.
-- mode "learn" (the vendor's quota headers): per bucket, set (or forget) the
-- learned rate and burst, and lower the level to what the vendor says remains.
-- The level is never raised, and tokens already reserved keep their schedule. A learned rate below the one in force starts a
-- settling period of one vendor window (`lt`, when it began): the requests
-- granted before, at the higher rate, stay in the vendor's count until the
-- window has passed, so until then the bucket may grant only what remains
-- beyond what the new rate will grant meanwhile: level <= remaining - rate x
-- (settling left). Afterwards the bucket's own pace bounds the window, and
-- level <= remaining.
--
-- KEYS[i]       global bucket i
-- ARGV[1]       mode: "block" | "drain" | "learn"
-- ARGV[2]       block: ms to block for (ignored by the others)
-- ARGV[3]       channel to PUBLISH the block's length (ms) on; "" = none
-- ARGV[1 + 3i]  rate of bucket i, tokens per ms (the policy's)
-- ARGV[2 + 3i]  burst of bucket i, tokens (the policy's)
-- ARGV[3 + 3i]  field: "" = the bucket is KEYS[i] itself; else its fields' prefix
--               in the hash KEYS[i] (the vendor's state, as in acquire.lua)
-- learn only, with n = #KEYS and j = 3 + 3n + 5(i - 1):
-- ARGV[j + 1]   learned rate, tokens per ms; "" = keep what is learned; "-" = forget it
-- ARGV[j + 2]   learned burst, tokens (with a rate)
-- ARGV[j + 3]   remaining: the most the bucket may hold now; "" = no limit
-- ARGV[j + 4]   the vendor's window, ms (the settling period after a lower rate)
-- ARGV[j + 5]   ms the learned rate and burst live from now unless learned again
--
-- Returns {until, level_1, ..., level_n} (learn: then rate_i, burst_i, settling_i
-- for each bucket), numbers as strings:
--   until       ms from now until the buckets grant again (0 for drain and learn)
--   level_i     tokens in bucket i now, after the change
--   rate_i      tokens per ms bucket i refills at now (the lower of policy and learned)
--   burst_i     tokens it holds at most now
--   settling_i  ms left of its settling period (0 = none)

local EPOCH = 1700000000
local time = redis.call('TIME')
local now = (tonumber(time[1]) - EPOCH) * 1000 + tonumber(time[2]) / 1000

local mode = ARGV[1]
local block = tonumber(ARGV[2])
local channel = ARGV[3]
local n = #KEYS

local out = {'0'}
local longest = 0
for i = 1, n do
  local rate, burst, field = tonumber(ARGV[1 + 3 * i]), tonumber(ARGV[2 + 3 * i]), ARGV[3 + 3 * i]
  local p = ''
  if field ~= '' then
    p = field .. ':'
  end
  local ft, fts = p .. 't', p .. 'ts'
  local state = redis.call('HMGET', KEYS[i], ft, fts, p .. 'lr', p .. 'lb', p .. 'lu', p .. 'lt')
  local learned = state[5] and tonumber(state[5]) > now
  if learned then
    rate, burst = math.min(rate, tonumber(state[3])), math.min(burst, tonumber(state[4]))
  end
  local level = burst
  if state[1] then
    level = math.min(burst, tonumber(state[1]) + (now - tonumber(state[2])) * rate)
  end
  local t, ts = level, now
  local write = true
  if mode == 'block' then
    local matured = now + math.max(0, -level) / rate
    t, ts = 0, math.max(now + block, matured)
    level = t - (ts - now) * rate
    longest = math.max(longest, ts - now)
    -- When: a slot kept before it is void (acquire.lua, "Kept slots"), as a hold is.
    redis.call('HSET', KEYS[i], p .. 'bk', string.format('%.3f', now))
  elseif mode == 'drain' then
    if level > 0 then
      t, level = 0, 0
    end
  else
    local j = 3 + 3 * n + 5 * (i - 1)
    local lr, lb, remaining = ARGV[j + 1], tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3])
    local window, ttl = tonumber(ARGV[j + 4]), tonumber(ARGV[j + 5])
    local policy_rate, policy_burst = tonumber(ARGV[1 + 3 * i]), tonumber(ARGV[2 + 3 * i])
    local new_rate, new_burst = rate, burst
    local since = tonumber(state[6])
    if lr == '-' then
      redis.call('HDEL', KEYS[i], p .. 'lr', p .. 'lb', p .. 'lu', p .. 'lt')
      new_rate, new_burst, since = policy_rate, policy_burst, nil
    elseif lr ~= '' then
      new_rate, new_burst = math.min(policy_rate, tonumber(lr)), math.min(policy_burst, lb)
      redis.call('HSET', KEYS[i], p .. 'lr', ARGV[j + 1], p .. 'lb', ARGV[j + 2],
        p .. 'lu', string.format('%.3f', now + ttl))
      if new_rate < rate * (1 - 1e-9) then
        since = now
        redis.call('HSET', KEYS[i], p .. 'lt', string.format('%.3f', since))
      end
    end
    local settling = 0
    if since and since + window > now then
      settling = since + window - now
    end
    -- Under the new rate the bucket follows a new line through the present one's: its level
    -- now, or, while tokens are reserved (below zero), the moment they have all matured, so
    -- that reservations granted at the old pace keep their places and new grants come after
    -- them (a faster refill must not slot new grants between the old ones).
    t, ts = level, now
    if level < 0 then
      t, ts = 0, now - level / rate
      level = -(ts - now) * new_rate
    end
    local target = math.min(level, new_burst)
    if remaining then
      target = math.min(target, remaining - new_rate * settling)
    end
    if target < level then
      t, ts, level = target, now, target
    end
    -- A missing bucket (full) stays missing unless lowered.
    write = state[1] ~= false or ts ~= now or t < new_burst
    rate, burst = new_rate, new_burst
    level = math.min(level, burst)
    out[1 + n + 3 * (i - 1) + 1] = string.format('%.17g', rate)
    out[1 + n + 3 * (i - 1) + 2] = string.format('%.6f', burst)
    out[1 + n + 3 * (i - 1) + 3] = string.format('%.3f', settling)
    if lr ~= '' and lr ~= '-' then
      -- The learned values live in the hash: it must outlive them.
      redis.call('PEXPIRE', KEYS[i], math.max(redis.call('PTTL', KEYS[i]), math.ceil(ttl) + 1000))
    end
  end
  if write then
    redis.call('HSET', KEYS[i], ft, string.format('%.6f', t), fts, string.format('%.3f', ts))
    local refilled = ts + (burst - t) / rate -- when this bucket reads full again
    if field == '' then
      local life = math.ceil(refilled - now) + 1000
      local until_ = tonumber(redis.call('HGET', KEYS[i], 'lu') or '0')
      redis.call('PEXPIRE', KEYS[i], math.max(life, math.ceil(until_ - now) + 1000))
    else
      -- The state hash lives until the last of its buckets is full again (acquire.lua's `horizon`).
      local horizon = tonumber(redis.call('HGET', KEYS[i], 'horizon') or '0')
      if refilled > horizon then
        horizon = refilled
        redis.call('HSET', KEYS[i], 'horizon', string.format('%.3f', horizon))
      end
      redis.call('PEXPIRE', KEYS[i], math.max(redis.call('PTTL', KEYS[i]), math.ceil(horizon - now) + 1000))
    end
  end
  out[1 + i] = string.format('%.6f', level)
end
out[1] = string.format('%.3f', longest)
if mode == 'block' and channel ~= '' then
  redis.call('PUBLISH', channel, out[1])
end
return out
