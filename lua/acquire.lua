-- acquire.lua: take `cost` tokens from every bucket and a lease in every lease
-- set of a request, or nothing at all.
--
-- Time is in milliseconds in this script, read from the server (TIME) and
-- shifted by EPOCH so that state stays exact when written with %.3f.
--
-- Buckets. A bucket is `t` tokens at time `ts` (ms): fields `t` and `ts` of its
-- own hash (a tenant's bucket), or fields `<field>:t` and `<field>:ts` of the
-- state hash (the vendor's global and endpoint buckets, per partition). Tokens
-- refill at `rate` per ms up to `burst`. `t` may be negative (tokens reserved by
-- holds, or drained by vendor feedback) and `ts` may lie in the future (a vendor
-- block: nothing refills before it). A missing bucket is full, so a bucket's own
-- key expires once it would have refilled to `burst`; the state hash lives until
-- the last of its buckets would have (its field `horizon`), plus `debt`.
--
-- Learned limits. A bucket may also hold `lr` (tokens per ms) and `lb` (tokens),
-- learned from the vendor's own quota headers until `lu` (ms, this clock), as
-- `<field>:lr`, `<field>:lb`, `<field>:lu` (feedback.lua, mode "learn"). While
-- `lu` lies ahead, the bucket refills at min(rate, lr) up to min(burst, lb): read
-- in the same HMGET as `t`/`ts`, no extra round trip; the policy's values are
-- never exceeded, and a vendor that stops saying so gets the policy back.
--
-- Leases. A lease set is a sorted set of the requests in flight to a vendor (or
-- an endpoint class), fleet-wide: member = lease id, score = when the lease
-- expires (a replica that died never releases; its leases run out). A request
-- gets a lease in each of its sets only if every set has fewer than its cap of
-- live leases, in the same step as its tokens: a full set refuses, taking
-- nothing. release.lua gives a lease back.
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
-- callers' hints out. A refusal by a full lease set takes no slot.
--
-- Lost state. A bucket's reservations (holds) live only in its level; should
-- the store lose its keys (restarted without persistence, FLUSHALL, a key
-- evicted or deleted, a failover to a replica that lags), the buckets would read
-- full while the reservations granted before still go out. The state hash holds
-- the vendor's global buckets together with `seq`, a counter raised by every
-- grant, and `lost`, when a loss was last seen: the buckets cannot vanish
-- without the counter. A caller that has seen `seq` before (seq_seen > 0, and
-- the state should still exist) and finds it missing, or behind what it saw,
-- has found a loss: `lost` = now. For `debt` ms after a loss, a bucket not
-- written since then counts as owing every reservation that may still be
-- outstanding (`rate` x the time left of that window): the fleet restarts from
-- below empty, never from full. No extra round trip.
--
-- KEYS[1 .. n]          the buckets (tenant buckets first, then endpoint, then global)
-- KEYS[n + 1 .. n + m]  the lease sets
-- KEYS[n + m + 1]       the deferral queue of this bucket set, when ARGV[3] = "q"
-- KEYS[#KEYS]           the state hash, when ARGV[4] ~= ""
-- ARGV[1]               cost: tokens to take from every bucket
-- ARGV[2]               max_wait: ms the caller will hold; 0 = grant only if available now
-- ARGV[3]               "q": a queue key follows the lease sets; "" = none (the hint is the wait)
-- ARGV[4]               seq_seen: the highest `seq` this caller has seen (0 = none); "" = no state
-- ARGV[5]               debt: ms after a loss during which reservations may be outstanding
-- ARGV[6]               n: the number of buckets
-- ARGV[7]               lease id ("" when m = 0)
-- ARGV[8]               lease life: ms a lease lives past the reservation's maturity
-- ARGV[6 + 3i]          rate of bucket i, tokens per ms
-- ARGV[7 + 3i]          burst of bucket i, tokens
-- ARGV[8 + 3i]          field: "" = the bucket is KEYS[i] itself; else its fields' prefix
--                       in the hash KEYS[i] (the state hash)
-- ARGV[8 + 3n + j]      cap of lease set j
--
-- Returns {granted, wait, binding, hint, seq, lost, full, ttl, level_1..level_n,
-- inflight_1..inflight_m}, as strings:
--   granted   1 = taken from every bucket and a lease in every set, 0 = nothing taken
--   wait      ms; granted: until the reservation matures (0 = go now);
--             refused: until every bucket could grant without waiting
--   binding   1-based index of the bucket with the longest wait, 0 when none waits
--   hint      ms; refused: when to retry, >= wait (the queue slot); granted: = wait
--   seq       the state's counter after this call (0 without a state)
--   lost      1 when this call found the state lost, else 0
--   full      1-based index of a lease set at its cap (nothing was taken), 0 = none
--   ttl       ms the state hash lives from now (0 without a state)
--   level_i   tokens in bucket i now (after the take when granted)
--   inflight_j  live leases in set j after this call

local EPOCH = 1700000000
local time = redis.call('TIME')
local now = (tonumber(time[1]) - EPOCH) * 1000 + tonumber(time[2]) / 1000

local cost = tonumber(ARGV[1])
local max_wait = tonumber(ARGV[2])
local debt = tonumber(ARGV[5])
local n = tonumber(ARGV[6])
local lease_id, lease_life = ARGV[7], tonumber(ARGV[8])
local m = #ARGV - 8 - 3 * n
local queue = nil
if ARGV[3] == 'q' then
  queue = KEYS[n + m + 1]
end

-- The state: seq, the window after a loss, and how long the hash must live.
local state = nil
local seq, lost, found_lost, horizon = 0, nil, 0, now
if ARGV[4] ~= '' then
  state = KEYS[#KEYS]
  local seen = tonumber(ARGV[4])
  local st = redis.call('HMGET', state, 'seq', 'lost', 'horizon')
  if st[1] then
    seq, lost, horizon = tonumber(st[1]), tonumber(st[2]), tonumber(st[3]) or now
  end
  if seen > 0 and (not st[1] or seq < seen) then
    found_lost, lost = 1, now
    seq = math.max(seq, seen)
    redis.call('HSET', state, 'seq', tostring(seq), 'lost', string.format('%.3f', now))
  end
end
local owing = 0 -- ms of possibly outstanding reservations a bucket untouched since the loss owes
if lost and now < lost + debt then
  owing = lost + debt - now
end

local levels, fields, rates, bursts = {}, {}, {}, {}
local wait, binding = 0, 0
for i = 1, n do
  local rate, burst, field = tonumber(ARGV[6 + 3 * i]), tonumber(ARGV[7 + 3 * i]), ARGV[8 + 3 * i]
  if field == '' then
    fields[i] = {'t', 'ts'}
  else
    fields[i] = {field .. ':t', field .. ':ts'}
  end
  local p = fields[i][1]:sub(1, -2) -- '' or '<field>:'
  local st = redis.call('HMGET', KEYS[i], fields[i][1], fields[i][2], p .. 'lr', p .. 'lb', p .. 'lu')
  if st[5] and tonumber(st[5]) > now then
    rate, burst = math.min(rate, tonumber(st[3])), math.min(burst, tonumber(st[4]))
  end
  rates[i], bursts[i] = rate, burst
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

local inflight, full = {}, 0
for j = 1, m do
  local set = KEYS[n + j]
  redis.call('ZREMRANGEBYSCORE', set, '-inf', string.format('%.3f', now))
  inflight[j] = redis.call('ZCARD', set)
  if full == 0 and inflight[j] >= tonumber(ARGV[8 + 3 * n + j]) then
    full = j
  end
end

local granted = 0
local hint = wait
local hashes = {} -- the hashes holding buckets by field (the state): they live until `horizon` + debt
if wait <= max_wait and full == 0 then
  granted = 1
  for i = 1, n do
    local rate, burst = rates[i], bursts[i]
    local level = levels[i] - cost
    levels[i] = level
    redis.call('HSET', KEYS[i], fields[i][1], string.format('%.6f', level), fields[i][2], string.format('%.3f', now))
    local refilled = math.ceil((burst - level) / rate)
    if ARGV[8 + 3 * i] == '' then
      redis.call('PEXPIRE', KEYS[i], refilled + 1000)
    else
      hashes[KEYS[i]] = true
      if now + refilled > horizon then
        horizon = now + refilled
      end
    end
  end
  local life = math.ceil(horizon - now + debt) + 1000
  for key in pairs(hashes) do
    if redis.call('PTTL', key) < life then
      redis.call('PEXPIRE', key, life)
    end
  end
  for j = 1, m do
    local set = KEYS[n + j]
    local expires = now + wait + lease_life
    redis.call('ZADD', set, string.format('%.3f', expires), lease_id)
    local last = redis.call('ZRANGE', set, -1, -1, 'WITHSCORES')
    redis.call('PEXPIRE', set, math.ceil(tonumber(last[2]) - now) + 1000)
    inflight[j] = inflight[j] + 1
  end
  if state then
    seq = redis.call('HINCRBY', state, 'seq', 1)
    redis.call('HSET', state, 'horizon', string.format('%.3f', horizon))
  end
elseif queue and full == 0 then
  local tail = tonumber(redis.call('GET', queue) or '0') - now
  if tail > hint then
    hint = tail
  end
  local step = cost / rates[binding]
  redis.call('SET', queue, string.format('%.3f', now + hint + step), 'PX', math.ceil(hint + step) + 1000)
end

local ttl = 0
if state then
  if found_lost == 1 and redis.call('PTTL', state) < debt + 1000 then
    redis.call('PEXPIRE', state, math.ceil(debt) + 1000)
  end
  ttl = math.max(redis.call('PTTL', state), 0)
end

local out = {tostring(granted), string.format('%.3f', wait), tostring(binding), string.format('%.3f', hint),
  tostring(seq), tostring(found_lost), tostring(full), tostring(ttl)}
for i = 1, n do
  out[8 + i] = string.format('%.6f', levels[i])
end
for j = 1, m do
  out[8 + n + j] = tostring(inflight[j])
end
return out
