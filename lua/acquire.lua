-- acquire.lua: take `cost` tokens from every bucket in KEYS, or from none.
--
-- Time is in milliseconds in this script, read from the server (TIME) and
-- shifted by EPOCH so that state stays exact when written with %.3f.
-- A bucket is `t` tokens at time `ts` (ms): fields `t` and `ts` of its own hash,
-- or, for a bucket kept in another hash (the vendor's state: its global buckets),
-- fields `<field>:t` and `<field>:ts` there. Tokens refill at `rate` per ms up
-- to `burst`. `t` may be negative (tokens reserved by holds, or drained by vendor
-- feedback) and `ts` may lie in the future (a vendor block: nothing refills
-- before it). A missing bucket is full, so a bucket's own key expires once it
-- would have refilled to `burst`; the state hash lives on (STATE_TTL).
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
-- Lost state. A bucket's reservations (holds) live only in its level; should
-- the store lose its keys (restarted without persistence, FLUSHALL, a key
-- evicted or deleted, a failover to a replica that lags), the buckets would read
-- full while the reservations granted before still go out. The vendor's state
-- hash holds its global buckets together with `seq`, a counter raised by every
-- grant, and `lost`, when a loss was last seen: the global buckets cannot vanish
-- without the counter. A caller that has seen `seq` before (seq_seen > 0) and
-- finds it missing, or behind what it saw, has found a loss: `lost` = now.
-- For `debt` ms after a loss, a bucket not written since then counts as owing
-- every reservation that may still be outstanding (`rate` x the time left of
-- that window): the fleet restarts from below empty, never from full, so no
-- window sees more than rate x window + burst. One more key in the same call:
-- no extra round trip.
--
-- KEYS[i]                     bucket i, i = 1..n (tenant buckets first, then global)
-- KEYS[n + 1]                 the deferral queue of this bucket set, when ARGV[3] = "q"
-- KEYS[last]                  the vendor's state key, when ARGV[4] ~= ""
-- ARGV[1]                     cost: tokens to take from every bucket
-- ARGV[2]                     max_wait: ms the caller will hold; 0 = grant only if available now
-- ARGV[3]                     "q": a queue key follows the buckets; "" = none (the hint is then the wait)
-- ARGV[4]                     seq_seen: the highest `seq` this caller has seen (0 = none yet);
--                             "" = no state key
-- ARGV[5]                     debt: ms after a loss during which reservations may be outstanding
-- ARGV[3 + 3i]                rate of bucket i, tokens per ms
-- ARGV[4 + 3i]                burst of bucket i, tokens
-- ARGV[5 + 3i]                field: "" = the bucket is KEYS[i] itself; else its fields'
--                             prefix in the hash KEYS[i] (the state key)
--
-- Returns {granted, wait, binding, hint, seq, lost, level_1, ..., level_n}, as strings:
--   granted  1 = taken from every bucket, 0 = taken from none
--   wait     ms; granted: until the reservation matures (0 = go now);
--            refused: until every bucket could grant without waiting
--   binding  1-based index of the bucket with the longest wait, 0 when none waits
--   hint     ms; refused: when to retry, >= wait (the queue slot); granted: = wait
--   seq      the state's counter after this call (0 without a state key)
--   lost     1 when this call found the state lost, else 0
--   level_i  tokens in bucket i now (after the take when granted)

local EPOCH = 1700000000
local STATE_TTL = 86400000 -- ms the state key outlives its vendor's last grant
local time = redis.call('TIME')
local now = (tonumber(time[1]) - EPOCH) * 1000 + tonumber(time[2]) / 1000

local cost = tonumber(ARGV[1])
local max_wait = tonumber(ARGV[2])
local n = (#ARGV - 5) / 3
local queue = nil
if ARGV[3] == 'q' then
  queue = KEYS[n + 1]
end

-- The state: seq, and the window after a loss.
local state = nil
local seq, lost, found_lost = 0, nil, 0
local debt = tonumber(ARGV[5])
if ARGV[4] ~= '' then
  state = KEYS[#KEYS]
  local seen = tonumber(ARGV[4])
  local st = redis.call('HMGET', state, 'seq', 'lost')
  if st[1] then
    seq = tonumber(st[1])
    lost = tonumber(st[2])
  end
  if seen > 0 and (not st[1] or seq < seen) then
    found_lost, lost = 1, now
    seq = math.max(seq, seen)
    redis.call('HSET', state, 'seq', tostring(seq), 'lost', string.format('%.3f', now))
    redis.call('PEXPIRE', state, STATE_TTL)
  end
end
local owing = 0 -- ms of possibly outstanding reservations a bucket untouched since the loss owes
if lost and now < lost + debt then
  owing = lost + debt - now
end

local levels, fields = {}, {}
local wait, binding = 0, 0
for i = 1, n do
  local rate, burst, field = tonumber(ARGV[3 + 3 * i]), tonumber(ARGV[4 + 3 * i]), ARGV[5 + 3 * i]
  if field == '' then
    fields[i] = {'t', 'ts'}
  else
    fields[i] = {field .. ':t', field .. ':ts'}
  end
  local st = redis.call('HMGET', KEYS[i], fields[i][1], fields[i][2])
  local level = burst
  if st[1] then
    level = math.min(burst, tonumber(st[1]) + (now - tonumber(st[2])) * rate)
  end
  if owing > 0 and (not st[1] or tonumber(st[2]) < lost) then
    level = math.min(level, -owing * rate)
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
    local rate, burst = tonumber(ARGV[3 + 3 * i]), tonumber(ARGV[4 + 3 * i])
    local level = levels[i] - cost
    levels[i] = level
    redis.call('HSET', KEYS[i], fields[i][1], string.format('%.6f', level), fields[i][2], string.format('%.3f', now))
    if ARGV[5 + 3 * i] == '' then
      redis.call('PEXPIRE', KEYS[i], math.ceil((burst - level) / rate) + 1000)
    else
      redis.call('PEXPIRE', KEYS[i], STATE_TTL)
    end
  end
  if state then
    seq = redis.call('HINCRBY', state, 'seq', 1)
    redis.call('PEXPIRE', state, STATE_TTL)
  end
elseif queue then
  local tail = tonumber(redis.call('GET', queue) or '0') - now
  if tail > hint then
    hint = tail
  end
  local step = cost / tonumber(ARGV[3 + 3 * binding])
  redis.call('SET', queue, string.format('%.3f', now + hint + step), 'PX', math.ceil(hint + step) + 1000)
end

local out = {tostring(granted), string.format('%.3f', wait), tostring(binding), string.format('%.3f', hint),
  tostring(seq), tostring(found_lost)}
for i = 1, n do
  out[6 + i] = string.format('%.6f', levels[i])
end
return out
