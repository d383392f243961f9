-- Kept slots whose owners left (acquire.lua, "Standby"): the worker's connection that held
-- them closed, so they are likely never claimed. Each is offered to one later refusal as
-- its hint; its owner may still claim it (a job re-enqueued with its Idempotency-Key). A
-- slot offered to one of these owners (`offers`), or named by a claim `~<slot>` (a caller
-- beyond the horizon was offered it), is offered again: its taker left too.
--
-- KEYS[1]   a bucket set's reservation set
-- KEYS[2]   its set of slots left by their owners
-- KEYS[3]   its slots offered, by the member of the slot of the caller told (acquire.lua)
-- ARGV      the claims (member names) left
--
-- Returns how many of them were still kept.

local n = 0
for i = 1, #ARGV do
  local claim = ARGV[i]
  if claim:sub(1, 1) == '~' then -- a slot offered to a caller beyond the horizon: offered again
    claim = claim:sub(2)
  end
  local score = redis.call('ZSCORE', KEYS[1], claim)
  if score then
    redis.call('ZADD', KEYS[2], score, claim)
    n = n + 1
    local offered = redis.call('HGET', KEYS[3], claim)
    if offered then
      redis.call('HDEL', KEYS[3], claim)
      local at = redis.call('ZSCORE', KEYS[1], offered)
      if at then
        redis.call('ZADD', KEYS[2], at, offered)
      end
    end
  end
end
if n > 0 then -- (a slot offered again is one more only where a claim was still kept)
  redis.call('PEXPIRE', KEYS[2], math.max(redis.call('PTTL', KEYS[1]), 1))
end
return n
