-- Kept slots whose owners left (acquire.lua, "Standby"): the worker's connection that held
-- them closed, so they are likely never claimed. Each is offered to one later refusal as
-- its hint; its owner may still claim it (a job re-enqueued with its Idempotency-Key).
--
-- KEYS[1]   a bucket set's reservation set
-- KEYS[2]   its set of slots left by their owners
-- ARGV      the claims (member names) left
--
-- Returns how many of them were still kept.

local n = 0
for i = 1, #ARGV do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score then
    redis.call('ZADD', KEYS[2], score, ARGV[i])
    n = n + 1
  end
end
if n > 0 then
  redis.call('PEXPIRE', KEYS[2], math.max(redis.call('PTTL', KEYS[1]), 1))
end
return n
