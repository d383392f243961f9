-- renew.lua: keep the leases of requests still in flight alive (acquire.lua).
--
-- A lease expires so that a replica that died frees its slots; a replica alive
-- renews its own leases, so a long download or a tunnel keeps its slot.
--
-- KEYS[i]       the lease set of lease i
-- ARGV[1]       life: ms each lease lives from now
-- ARGV[1 + i]   lease i's id
--
-- Returns the number of leases renewed (a lease already gone is not revived).

local EPOCH = 1700000000
local time = redis.call('TIME')
local now = (tonumber(time[1]) - EPOCH) * 1000 + tonumber(time[2]) / 1000

local life = tonumber(ARGV[1])
local expires = math.ceil(now + life) -- whole ms, as acquire.lua writes them
local renewed = 0
for i = 1, #KEYS do
  renewed = renewed + redis.call('ZADD', KEYS[i], 'XX', 'GT', 'CH', expires, ARGV[1 + i])
  if redis.call('PTTL', KEYS[i]) < expires - now + 1000 then -- never shortened
    redis.call('PEXPIRE', KEYS[i], math.ceil(expires - now) + 1000)
  end
end
return renewed
