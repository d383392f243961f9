-- presence.lua: a replica says it is alive, and learns how many are.
--
-- With `store.on_failure: local` every replica announces itself about once a
-- second, so that, should the store fail, each knows how many shares to divide
-- every limit into (proxy/limiter/degraded.py). The replica set is a sorted
-- set: member = replica id, score = when it last announced, in ms on the
-- server's clock (TIME, shifted by EPOCH as in acquire.lua). A replica silent
-- for `stale` ms (it died, or cannot reach the store) no longer counts. The set
-- expires when every replica has been silent that long.
--
-- KEYS[1]   the replica set
-- ARGV[1]   this replica's id
-- ARGV[2]   stale: ms after which a silent replica no longer counts
-- ARGV[3]   "leave": remove this replica (it is shutting down); "" = announce
--
-- Returns the number of replicas alive now: those that announced within `stale`
-- ms, this one included (unless it left).

local EPOCH = 1700000000
local time = redis.call('TIME')
local now = (tonumber(time[1]) - EPOCH) * 1000 + tonumber(time[2]) / 1000
local stale = tonumber(ARGV[2])

if ARGV[3] == 'leave' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  redis.call('ZADD', KEYS[1], string.format('%.3f', now), ARGV[1])
  redis.call('PEXPIRE', KEYS[1], math.ceil(stale))
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('(%.3f', now - stale))
return redis.call('ZCARD', KEYS[1])
