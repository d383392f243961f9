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
-- expires, in whole ms (a replica that died never releases; its leases run out).
-- Whole: a small sorted set keeps its scores in a listpack, where a fraction is
-- text parsed again at every comparison (ZADD several times slower). A request
-- gets a lease in each of its sets only if every set has fewer than its cap of
-- live leases, in the same step as its tokens: a full set refuses, taking
-- nothing. release.lua gives a lease back.
--
-- Deferral queue. Refused callers are told when to retry. Told all the same
-- moment (when the binding bucket next holds `cost`), precise retriers come back
-- together and all but one are refused again: a herd. So a refusal is given the
-- next free slot of its bucket set's queue instead: the queue key holds the time
-- (same clock) the last caller pointed at takes its cost; the next is pointed at one slot,
-- `cost / rate` of its binding bucket, later (its own cost: a metered call's estimate
-- varies, and one told when the caller before it could go came back short). The queue is a
-- schedule of hints, not a reservation: nothing is taken from any bucket, and a
-- caller that never comes back costs the others nothing but a later hint. It is
-- kept per bucket set (per tenant), so a tenant that floods only pushes its own
-- callers' hints out. A refusal by a full lease set takes no slot. Nobody keeps to the
-- schedule to the letter (a settlement gives back what a metered call did not use, a
-- caller takes tokens between two told ones): a grant that finds the slowest of its buckets
-- overflowed (it stood full while the callers told a slot slept, and lost tokens) starts
-- the queue again, and the next caller refused is told the real wait.
--
-- Lost state. A bucket's reservations (holds) live only in its level; should
-- the store lose its keys (restarted without persistence, FLUSHALL, a key
-- evicted or deleted, a failover to a replica that lags), the buckets would read
-- full while the reservations granted before still go out. The state hash holds
-- the vendor's global buckets together with `seq`, a counter raised by every
-- grant, and `lost`, when a loss was last seen: the buckets cannot vanish
-- without the counter. A caller that has seen `seq` before (seq_seen > 0, and
-- the state should still exist) and finds it missing, or behind what it saw,
-- has found a loss: `lost` = now. A bucket not written since the loss restarts
-- at the loss owing every reservation that may still be outstanding (`debt` ms
-- of its refill) and refills from there: the fleet restarts from below empty,
-- never from full, and never bursts after the debt either. No extra round trip.
--
-- Kept slots. A hint alone is not enough to spend the whole quota: a caller that
-- comes back a few ms late finds its token taken by whoever came first, or, with a
-- small burst, finds that the bucket stopped filling while it was on its way; and
-- an SDK that retries early, whatever the hint, takes a new slot each time. So a
-- refusal whose wait is at most `horizon` (the caller will come back: it was told
-- to retry) keeps its slot: its tokens are taken as a hold's are (the level goes
-- below zero, so callers refused after it get later slots), and the reservation is
-- a member of the bucket set's reservation set, scored by when it matures. Its
-- member name is the caller's claim: the proxy remembers it
-- with the worker's connection and sends it with that connection's next request
-- of the bucket set. A claim that has matured (or will within `max_wait`) is
-- granted without taking tokens again; one that has not is refused again with the
-- same slot, never a new one. A reservation its owner does not claim within
-- `owner` ms of maturing may be claimed by any request of the bucket set without
-- one (a caller whose job was re-enqueued elsewhere, or who never comes back). One
-- nobody claims within `life` ms is dropped: its tenant buckets get its tokens back
-- (never above their burst), the vendor-side ones do not. A level is a count, not a
-- schedule: a token given back to it is granted at the end of the slots already
-- given out, on top of the last of them, and a vendor counting a strict window sees
-- one request too many; its own slot's time has passed, and with it the token's.
-- A reservation made before a vendor block (a bucket's `bk`) or before the
-- state was lost is void: the block, or the loss, absorbed it. When the tenant's own
-- buckets are what refused (`binding` among the first `tenants`), only they are taken
-- (scope `t`): a vendor-side token taken now would stand idle until the tenant's
-- bucket lets the request go, holding back every other tenant meanwhile; the
-- vendor-side buckets are taken when the slot is claimed (or, if they have no room
-- then, the slot is kept again on every bucket, scope `a`). Member names are
-- `<created ms>:<cost>:<scope>`, `:<k>` after them for a second one in one microsecond.
--
-- KEYS[1 .. n]          the buckets (tenant buckets first, then endpoint, then global)
-- KEYS[n + 1 .. n + m]  the lease sets
-- KEYS[n + m + 1]       the deferral queue of this bucket set, when ARGV[3] = "q"
-- KEYS[n + m + 2]       its reservation set, when ARGV[10] ~= "" (with a queue), then the
--                       set of those of its slots whose owners left (leave.lua), then the
--                       moves of late slots ("Late slots"), then the slots offered ("Standby")
-- KEYS[.. + 1 ..]       with a share (ARGV[11] ~= ""): its hash, its expiry set, then per class
--                       its waiting sets and then its tag sets ("Share")
-- KEYS[#KEYS]           the state hash, when ARGV[4] ~= ""
-- ARGV[1]               cost: tokens to take from every bucket; or "<cost>|<c_1>,...,<c_n>":
--                       bucket i takes c_i (a meter's estimate, SPEC §14), the request's
--                       cost is still `cost` (its share's turn); its kept slot holds c_i in
--                       bucket i (late, they serve other calls bucket by bucket: "Late
--                       slots"), and a claim of it by a call of other costs takes (or gives
--                       back) the difference
-- ARGV[2]               max_wait: ms the caller will hold; 0 = grant only if available now
-- ARGV[3]               "q": a queue key follows the lease sets; "" = none (the hint is the wait)
-- ARGV[4]               seq_seen: the highest `seq` this caller has seen (0 = none); "" = no state
-- ARGV[5]               debt: ms after a loss during which reservations may be outstanding
-- ARGV[6]               n: the number of buckets
-- ARGV[7]               lease id ("" when m = 0)
-- ARGV[8]               lease life: ms a lease lives past the reservation's maturity
-- ARGV[9]               claim: the reservation this caller holds ("" = none); after a "?",
--                       one it may claim only once it has matured (else it is a new caller);
--                       after a "~", a slot it was offered ("Standby"): it claims none
-- ARGV[10]              "<horizon>:<owner>:<life>:<tenants>:<standby>" (ms, how many of the
--                       buckets are the tenant's own, ms): refusals keep their slot; "" = they do not
-- ARGV[11]              "<class>:<classes>:<weight>:<min_share>:<horizon>:<tau>:<grace>:<cgrace>:<slack>:<g>"
--                       (class 1-based, highest first; ms; g: the first global bucket), "" = no share
-- ARGV[12]              the tenant's member in the share's sets, "<weight>|<tenant>"
-- ARGV[10 + 3i]         rate of bucket i, tokens per ms
-- ARGV[11 + 3i]         burst of bucket i, tokens
-- ARGV[12 + 3i]         field: "" = the bucket is KEYS[i] itself; else its fields' prefix
--                       in the hash KEYS[i] (the state hash)
-- ARGV[12 + 3n + j]     cap of lease set j
--
-- Returns {granted, wait, binding, hint, seq, lost, full, ttl, level_1..level_n,
-- inflight_1..inflight_m, reserved, claimed}, as strings:
--   granted   1 = taken from every bucket (or a claim) and a lease in every set, 0 = nothing taken
--   wait      ms; granted: until the reservation matures (0 = go now; a kept slot claimed
--             after it matured: how long ago, negative);
--             refused: until every bucket could grant without waiting (a kept slot: until it matures)
--   binding   1-based index of the bucket with the longest wait, 0 when none waits
--   hint      ms; refused: when to retry, >= wait (the queue slot; a slot kept: its time, or
--             earlier, a slot left by its owner, "Standby"); granted: = wait; refused
--             by a full lease set: how long its oldest lease has been out
--   seq       the state's counter after this call (0 without a state)
--   lost      1 when this call found the state lost, else 0
--   full      1-based index of a lease set at its cap (nothing was taken), 0 = none
--   ttl       ms the state hash lives from now (0 without a state)
--   level_i   tokens in bucket i now (after the take when granted)
--   inflight_j  live leases in set j after this call
--   reserved  refused: the claim of the slot kept for this caller ("" = none)
--   claimed   1 = granted on a reservation (its tokens were taken when it was made)

local EPOCH = 1700000000
local time = redis.call('TIME')
local now = (tonumber(time[1]) - EPOCH) * 1000 + tonumber(time[2]) / 1000

local cost = tonumber(ARGV[1])
local max_wait = tonumber(ARGV[2])
local debt = tonumber(ARGV[5])
local n = tonumber(ARGV[6])
local costs = {} -- what each bucket takes
local cost_text, metered = ARGV[1], false
if not cost then
  local c, list = string.match(ARGV[1], '^([^|]+)|(.*)$')
  cost, cost_text, metered = tonumber(c), c, true
  for x in string.gmatch(list, '[^,]+') do
    costs[#costs + 1] = tonumber(x)
  end
end
for i = #costs + 1, n do
  costs[i] = cost
end
local lease_id, lease_life = ARGV[7], tonumber(ARGV[8])
local claim = ARGV[9]
local F = 12 -- fixed arguments before the buckets'
local m = #ARGV - F - 3 * n
local queue = nil
if ARGV[3] == 'q' then
  queue = KEYS[n + m + 1]
end
local rset, left, shifts, offers, horizon_ms, owner_ms, life_ms, tenants, standby_ms = nil, nil, nil, 0, 0, 0, 0, 0
if ARGV[10] ~= '' then
  rset, left, shifts, offers = KEYS[n + m + 2], KEYS[n + m + 3], KEYS[n + m + 4], KEYS[n + m + 5]
  local h, o, l, t, s = string.match(ARGV[10], '^([^:]+):([^:]+):([^:]+):([^:]+):([^:]+)$')
  horizon_ms, owner_ms, life_ms, tenants, standby_ms = tonumber(h), tonumber(o), tonumber(l), tonumber(t), tonumber(s)
end

local share = nil -- SPEC §13: this request's place in the vendor's schedule (see "Share")
if ARGV[11] ~= '' then
  local c, k, w, ms, h, tau, grace, cgrace, slack, g, metered = string.match(ARGV[11],
    '^([^:]+):([^:]+):([^:]+):([^:]+):([^:]+):([^:]+):([^:]+):([^:]+):([^:]+):([^:]+):?([^:]*)$')
  k = tonumber(k)
  local base = #KEYS - 2 - 2 * k
  if ARGV[4] ~= '' then
    base = base - 1
  end
  share = {c = tonumber(c), k = k, w = tonumber(w), min = tonumber(ms), horizon = tonumber(h),
    tau = tonumber(tau), grace = tonumber(grace), cgrace = tonumber(cgrace), slack = tonumber(slack),
    g = tonumber(g), last = n - (tonumber(metered) or 0), -- (a meter's buckets after the global ones)
    member = ARGV[12], hash = KEYS[base + 1], exp = KEYS[base + 2], waiting = {}, tags = {}}
  for i = 1, k do
    share.waiting[i] = KEYS[base + 2 + i]
    share.tags[i] = KEYS[base + 2 + k + i]
  end
end

-- Reads and writes go one command per hash: every bucket kept in the state hash (and the
-- state's own fields) in one HMGET, and in one HSET at the end (`flush`). A call into
-- Redis costs more here than the Lua around it.
local asks, replies, writes = {}, {}, {}
local function ask(key, names) -- the offset of `names` in the key's HMGET reply
  local a = asks[key]
  if not a then
    a = {}
    asks[key] = a
  end
  local at = #a
  for k = 1, #names do
    a[at + k] = names[k]
  end
  return at
end
local function put(key, name, value) -- a field for the key's HSET (a later one wins)
  local w = writes[key]
  if not w then
    w = {}
    writes[key] = w
  end
  w[#w + 1] = name
  w[#w + 1] = value
end

local state = nil
local state_at = 0
if ARGV[4] ~= '' then
  state = KEYS[#KEYS]
  state_at = ask(state, {'seq', 'lost', 'horizon'})
end
if share then -- the schedule's hash: per class the waiting weights, busy-until, credit and its time
  local names = {'x'}
  for i = 1, share.k do
    names[#names + 1] = 'w' .. i
    names[#names + 1] = 'b' .. i
    names[#names + 1] = 'c' .. i
    names[#names + 1] = 'u' .. i
  end
  share.at = ask(share.hash, names)
end
local fields, at = {}, {}
for i = 1, n do
  local field = ARGV[F + 3 * i]
  local p = ''
  if field ~= '' then
    p = field .. ':'
  end
  fields[i] = {p .. 't', p .. 'ts', p .. 'lr', p .. 'lb', p .. 'lu', p .. 'bk', p .. 'z', p .. 'zh'}
  at[i] = ask(KEYS[i], fields[i])
end
for key, names in pairs(asks) do
  replies[key] = redis.call('HMGET', key, unpack(names))
end

-- The state: seq, the window after a loss, and how long the hash must live.
local seq, lost, found_lost, horizon = 0, nil, 0, now
if state then
  local seen = tonumber(ARGV[4])
  local r = replies[state]
  if r[state_at + 1] then
    seq, lost, horizon = tonumber(r[state_at + 1]), tonumber(r[state_at + 2]), tonumber(r[state_at + 3]) or now
  end
  if seen > 0 and (not r[state_at + 1] or seq < seen) then
    found_lost, lost = 1, now
    seq = math.max(seq, seen)
    put(state, 'seq', seq)
    put(state, 'lost', string.format('%.3f', now))
  end
end

local levels, rates, bursts = {}, {}, {}
local overflowed = {} -- bucket i stood full since it was last written ("Deferral queue")
local restart = false -- this grant starts the deferral queue again
-- above[i]: when bucket i last stood above empty before this call (`z`, written by every call
-- that writes the bucket: now if its level had been, or is, above 0; see "Late slots"), and
-- half[i] above half its burst (`zh`); now for a bucket not written (full) or written before
-- they were (not known).
local above, half, pre = {}, {}, {}
local void_before = lost or 0 -- reservations made before this are void (a loss, a vendor block)
for i = 1, n do
  local rate, burst = tonumber(ARGV[F + 3 * i - 2]), tonumber(ARGV[F + 3 * i - 1])
  local r, o = replies[KEYS[i]], at[i]
  local st = {r[o + 1], r[o + 2], r[o + 3], r[o + 4], r[o + 5], r[o + 6], r[o + 7], r[o + 8]}
  if st[5] and tonumber(st[5]) > now then
    rate, burst = math.min(rate, tonumber(st[3])), math.min(burst, tonumber(st[4]))
  end
  rates[i], bursts[i] = rate, burst
  local level, over = burst, true
  if st[1] then
    level = tonumber(st[1]) + (now - tonumber(st[2])) * rate
    level, over = math.min(burst, level), level > burst
  end
  if lost and (not st[1] or tonumber(st[2]) < lost) then
    -- Untouched since the loss: it restarts from below empty at the loss, owing what
    -- may be outstanding, and refills from there; never full (SPEC §12).
    level = math.min(level, (now - lost - debt) * rate)
    over = level >= burst
  end
  overflowed[i] = over
  if st[6] and tonumber(st[6]) > void_before then
    void_before = tonumber(st[6])
  end
  levels[i], pre[i], above[i], half[i] = level, level, now, now
  if st[1] and st[7] and st[8] then
    above[i], half[i] = tonumber(st[7]), tonumber(st[8])
  end
end

-- Kept slots: reservations nobody claimed in time go back to the buckets they took from
-- (those made before a block or a loss were absorbed by it: dropped); then this caller's
-- claim, or one whose owner is late, is looked for.
local function parse(member) -- a metered slot's member ends ":m<tenant bucket costs>"
  local created, taken, scope = string.match(member, '^([^:]+):([^:]+):([at])')
  local own = string.match(member, '^[^:]+:[^:]+:[at]:m([^:]*)')
  local tcosts = nil
  if own then
    tcosts = {}
    for x in string.gmatch(own, '[^,]+') do
      tcosts[#tcosts + 1] = tonumber(x)
    end
  end
  return tonumber(created), tonumber(taken), scope, tcosts
end
-- A move's units (acquire.lua's `shifts`): one number for every bucket, or "u_1,...,u_n".
local function units_of(text)
  local u = {}
  if string.find(text, ',', 1, true) then
    for x in string.gmatch(text, '[^,]+') do
      u[#u + 1] = tonumber(x)
    end
  else
    u[0] = tonumber(text)
  end
  return u
end
local refunded = false
local held = nil -- the member this call claims
local mine = '' -- the slot this caller holds, if any (a weak claim's too)
local claim_wait = 0
local early = nil -- this caller's own claim, not matured: refused with its slot
-- Only a reservation past its owner's time can be stale or late: when the earliest is not,
-- neither is looked for (one command where there would be two, on every call).
local due = false
if rset then
  local first = redis.call('ZRANGE', rset, 0, 0, 'WITHSCORES')
  due = first[2] ~= nil and tonumber(first[2]) <= now - math.min(owner_ms, life_ms)
end
if rset and due then
  local stale = redis.call('ZRANGEBYSCORE', rset, '-inf', string.format('(%.3f', now - life_ms))
  for _, member in ipairs(stale) do
    local created, taken, _, tcosts = parse(member)
    if created > void_before and tenants > 0 then
      for i = 1, tenants do
        levels[i] = math.min(bursts[i], levels[i] + (tcosts and tcosts[i] or taken))
      end
      refunded = true
    end
  end
  if #stale > 0 then
    redis.call('ZREMRANGEBYSCORE', rset, '-inf', string.format('(%.3f', now - life_ms))
    redis.call('ZREMRANGEBYSCORE', left, '-inf', string.format('(%.3f', now - life_ms))
  end
end
if rset then
  local weak = claim:sub(1, 1) == '?' -- a claim honoured only once its slot has matured
  if weak then
    claim = claim:sub(2)
  end
  if claim:sub(1, 1) == '~' then -- a slot offered, not its own: it asks as a new caller
    claim = ''
  end
  mine = claim
  if claim ~= '' then
    local score = redis.call('ZSCORE', rset, claim)
    if score and parse(claim) <= void_before then
      redis.call('ZREM', rset, claim)
    elseif score then
      score = tonumber(score)
      if score - now <= max_wait then
        held, claim_wait = claim, score - now
      elseif not weak then
        early = score - now
      end
    end
    if weak and not held then
      claim = ''
    end
  end
end

-- Share (SPEC §13): the vendor's global buckets divided among whoever is waiting. A
-- tenant waits in its class with a tag (start-time fair queuing): each grant moves its tag
-- on by cost / weight, and a tenant may take only while its tag is at most one of its own
-- requests (or `slack` ms of the quota, if more) ahead of the lowest tag of its class's
-- waiting tenants (one a few ms from asking again holds no one back), or while the quota
-- has a token more than that tenant's (tokens do not pile up for one that is not there:
-- it lost nothing it was there for, and a pile let go at once bunches at the vendor);
-- so over any stretch the
-- tenants waiting receive in proportion to their weights, and whoever is alone (no one
-- else waiting) receives everything. A tenant waits from a refusal (by the gate or a
-- vendor-side bucket, never its own tenant bucket: its own cap is not the quota) until it
-- is expected back (its retry, at most `tau` ahead) plus `grace`: a tenant that stopped
-- holds the others back no longer than that. Its tag outlives its wait while anyone of the
-- class waits (a precise retrier keeps its place); the tags go once none does. A class
-- with a request refused is busy until that request is expected back (plus `cgrace`):
-- meanwhile lower classes take a token only on credit, min_share of the quota accrued
-- while they ask, or when one more stays for the higher class (tokens do not pile up
-- while it is on its way: a pile let go at once would bunch at the vendor). A grant under a share reserves at most `horizon` ahead: a request that
-- must wait longer is refused with its turn, and (a hold) asks again then, so that a
-- later request of a higher class or a tenant further behind is not queued behind it;
-- one on credit reserves as far as it holds (its class's min_share is its due, whatever
-- the higher class asks meanwhile).
-- Keys: the schedule's hash (per class i: `w<i>` the waiting tenants' weights summed,
-- `b<i>` busy until, `c<i>`/`u<i>` credit and when it accrued; `x` the first expiry), the
-- expiry set (`<i>|<member>` by when its wait ends), per class the waiting set and the
-- tag set (`<weight>|<tenant>` by tag). All in the vendor's slot: no extra round trip.
local gate_ok, gate_wait, gate_step, credit_used = true, 0, nil, false
local sh = nil

-- `member` waits no more in class `i`; its class's tags go once no one waits, and those
-- below the lowest waiting one (they count as it: tenants sprayed leave nothing behind).
local function share_left(i, member)
  if redis.call('ZREM', share.waiting[i], member) == 1 then
    sh.w[i] = sh.w[i] - (tonumber(string.match(member, '^([^|]+)|')) or 0)
  end
  if sh.w[i] <= 1e-9 or redis.call('ZCARD', share.waiting[i]) == 0 then
    sh.w[i] = 0
    redis.call('DEL', share.waiting[i], share.tags[i])
  else
    local low = redis.call('ZRANGE', share.waiting[i], 0, 0, 'WITHSCORES')
    redis.call('ZREMRANGEBYSCORE', share.tags[i], '-inf', '(' .. low[2])
  end
  sh.dirty = true
end
if share then
  local r, at0 = replies[share.hash], share.at
  sh = {x = tonumber(r[at0 + 1]), w = {}, b = {}, cr = {}, u = {}, dirty = false}
  for i = 1, share.k do
    local o = at0 + 1 + 4 * (i - 1)
    sh.w[i], sh.b[i] = tonumber(r[o + 1]) or 0, tonumber(r[o + 2]) or 0
    sh.cr[i], sh.u[i] = tonumber(r[o + 3]) or 0, tonumber(r[o + 4])
  end
  if sh.x and sh.x <= now then -- tenants whose wait ended leave their class's waiting set
    local at_now = string.format('%.3f', now)
    local gone = redis.call('ZRANGEBYSCORE', share.exp, '-inf', at_now)
    for _, member in ipairs(gone) do
      local i, rest = string.match(member, '^(%d+)|(.*)$')
      i = tonumber(i)
      if i and i <= share.k then
        share_left(i, rest)
      end
    end
    redis.call('ZREMRANGEBYSCORE', share.exp, '-inf', at_now)
    local first = redis.call('ZRANGE', share.exp, 0, 0, 'WITHSCORES')
    sh.x = tonumber(first[2])
    sh.dirty = true
  end
  -- The slowest of the vendor's global request buckets (a meter's first, without them) sets
  -- the schedule's unit; a metered call's turn counts the quota's part it takes most of (its
  -- cost in each meter bucket as that bucket's time, in units: weights divide each meter),
  -- and `room` is how many more of this call the tightest bucket holds after it (one
  -- request, or this estimate): under one, it dips into what a higher class waits for.
  local rate, room = math.huge, math.huge
  for i = share.g, share.last do
    rate, room = math.min(rate, rates[i]), math.min(room, levels[i] - costs[i])
  end
  local scost = cost
  if rate == math.huge then
    rate, scost = rates[share.last + 1] or 1, 0
  end
  for i = share.last + 1, n do -- (a meter's own buckets: fields "m:..."; its tenants' are their caps)
    if costs[i] > 0 and string.sub(ARGV[F + 3 * i], 1, 2) == 'm:' then
      scost, room = math.max(scost, costs[i] * rate / rates[i]), math.min(room, levels[i] / costs[i] - 1)
    end
  end
  share.cost = scost
  local c = share.c
  local busy = 0
  for i = 1, c - 1 do
    if sh.b[i] > busy then
      busy = sh.b[i]
    end
  end
  local class_rate = rate
  if busy <= now and sh.cr[c] > 0 then -- credit is for while a higher class waits, not to keep
    sh.cr[c], sh.dirty = 0, true
  end
  if busy > now and room < 1 then -- a higher class is waiting: this one takes only on credit
    local credit = sh.cr[c]
    if sh.u[c] and now - sh.u[c] < 1000 then
      credit = credit + (now - sh.u[c]) * share.min * rate
    end
    credit = math.min(credit, math.max(scost, 1) + share.min * rate * 50) -- (50 ms of it: asks come late)
    sh.cr[c], sh.u[c], sh.dirty = credit, now, true
    class_rate = share.min * rate
    if credit >= scost then
      credit_used = true
    else
      gate_ok = false
      gate_wait = math.max(gate_wait, busy - now)
      if share.min > 0 then
        gate_wait = math.min(gate_wait, (scost - credit) / class_rate)
      end
    end
  end
  share.F, share.V = 0, nil
  if sh.w[c] > 0 then
    local first = redis.call('ZRANGE', share.waiting[c], 0, 0, 'WITHSCORES')
    share.V = tonumber(first[2])
  end
  if share.V then
    local f = tonumber(redis.call('ZSCORE', share.tags[c], share.member)) or share.V
    share.F = math.max(f, share.V)
    local ahead = share.F - share.V - math.max(scost, rate * share.slack) / share.w
    if ahead > 0 and room < 1 then -- the tenants behind it take theirs first (tokens to spare: not held)
      local behind = ahead * sh.w[c] / math.max(class_rate, 1e-9)
      if gate_ok then
        gate_ok, gate_wait = false, math.max(gate_wait, behind)
      elseif behind > gate_wait then
        gate_wait = behind
      end
    end
    gate_step = scost * sh.w[c] / (share.w * math.max(class_rate, 1e-9)) -- its fair interval
  end
  if not gate_ok and share.min > 0 and busy > now then
    gate_step = math.max(gate_step or 0, scost / class_rate)
  end
end

local function share_granted(held_for)
  local c = share.c
  if credit_used then
    sh.cr[c], sh.dirty = sh.cr[c] - share.cost, true
  end
  if held_for > 0 and now + held_for + share.cgrace > sh.b[c] then -- a hold waits: its class is busy
    sh.b[c], sh.dirty = now + held_for + share.cgrace, true
  end
  if share.V then
    local tag = string.format('%.6f', share.F + share.cost / share.w)
    redis.call('ZADD', share.tags[c], tag, share.member)
    redis.call('ZADD', share.waiting[c], 'XX', tag, share.member) -- still waiting: its place moves on
  end
end

local function share_load() -- its tag, when no one of its class was waiting (not read then)
  if not share.V then
    share.F = tonumber(redis.call('ZSCORE', share.tags[share.c], share.member)) or 0
  end
end

-- It waits: in its class's waiting set by its tag, until it is expected back.
local function share_waits(retry, kept) -- (kept: a slot is kept for it, it comes back then)
  local c = share.c
  share_load()
  local back = math.max(retry, 0)
  if not kept then
    back = math.min(back, share.tau)
  end
  if redis.call('ZSCORE', share.waiting[c], share.member) == false then
    sh.w[c] = sh.w[c] + share.w
  end
  redis.call('ZADD', share.waiting[c], string.format('%.6f', share.F), share.member)
  redis.call('ZADD', share.tags[c], 'GT', string.format('%.6f', share.F), share.member)
  local ends = now + back + share.grace
  redis.call('ZADD', share.exp, 'GT', string.format('%.3f', ends), c .. '|' .. share.member)
  if not sh.x or ends < sh.x then
    sh.x = ends
  end
  if now + back + share.cgrace > sh.b[c] then
    sh.b[c] = now + back + share.cgrace
  end
  for _, key in ipairs({share.waiting[c], share.tags[c], share.exp}) do
    redis.call('PEXPIRE', key, 60000)
  end
  sh.dirty = true
end

local function share_leaves() -- held by its own limit (or its endpoint's), not by the quota
  local c = share.c
  if sh.w[c] > 0 and redis.call('ZREM', share.exp, c .. '|' .. share.member) == 1 then
    share_left(c, share.member)
  end
end

-- The wait over every bucket, and over the vendor-side ones alone (what a slot kept on
-- the tenant's own buckets still needs when it is claimed).
local wait, binding, vendor_wait = 0, 0, 0
for i = 1, n do
  local need = (costs[i] - levels[i]) / rates[i]
  if need > wait then
    wait, binding = need, i
  end
  if i > tenants and need > vendor_wait then
    vendor_wait = need
  end
end

local inflight, full = {}, 0
for j = 1, m do
  local set, cap = KEYS[n + j], tonumber(ARGV[F + 3 * n + j])
  local count = redis.call('ZCARD', set)
  if count >= cap then
    -- Expired leases (a replica that died) count until dropped: dropped where they would
    -- refuse (release.lua drops them too), not on every grant.
    redis.call('ZREMRANGEBYSCORE', set, '-inf', now)
    count = redis.call('ZCARD', set)
  end
  inflight[j] = count
  if full == 0 and count >= cap then
    full = j
  end
end

-- Write every bucket's level as of now (after a take, or a refund of unclaimed slots), in
-- `flush`.
local own, hashes = {}, {} -- a bucket's own key: its life; the hashes holding buckets by field
local function write_levels()
  local at_now = string.format('%.3f', now)
  for i = 1, n do
    local rate, burst, level = rates[i], bursts[i], levels[i]
    put(KEYS[i], fields[i][1], string.format('%.6f', level))
    put(KEYS[i], fields[i][2], at_now)
    local high = math.max(level, pre[i])
    put(KEYS[i], fields[i][7], (high > 0 or above[i] == now) and at_now or string.format('%.3f', above[i]))
    put(KEYS[i], fields[i][8], (high > burst / 2 or half[i] == now) and at_now or string.format('%.3f', half[i]))
    local refilled = math.ceil((burst - level) / rate)
    if ARGV[F + 3 * i] == '' then
      own[KEYS[i]] = refilled + 1000
    else
      hashes[KEYS[i]] = true
      if now + refilled > horizon then
        horizon = now + refilled
      end
    end
  end
end

-- The writes, then the keys' lives: a bucket's own key until it would have refilled, a
-- hash of buckets (the state) until the last of them would have, plus `debt`.
local state_ttl = nil
local function flush()
  for key, w in pairs(writes) do
    redis.call('HSET', key, unpack(w))
  end
  for key, life in pairs(own) do
    redis.call('PEXPIRE', key, life)
  end
  local life = math.ceil(horizon - now + debt) + 1000
  for key in pairs(hashes) do
    local ttl = redis.call('PTTL', key)
    if ttl < life then
      redis.call('PEXPIRE', key, life)
      ttl = life
    end
    if key == state then
      state_ttl = ttl
    end
  end
end

local function take_leases(matures)
  local expires = math.ceil(matures + lease_life)
  for j = 1, m do
    local set = KEYS[n + j]
    redis.call('ZADD', set, expires, lease_id)
    -- The set outlives its last lease: extended by a whole lease life more when needed,
    -- so that most grants need not extend it.
    local left = expires - now + 1000
    if redis.call('PTTL', set) < left then
      redis.call('PEXPIRE', set, math.ceil(left + lease_life))
    end
    inflight[j] = inflight[j] + 1
  end
end

local function count_grant()
  if state then
    seq = seq + 1
    put(state, 'seq', seq)
    put(state, 'horizon', string.format('%.3f', horizon))
  end
end

local function take(first, last)
  for i = first, last do
    levels[i] = levels[i] - costs[i]
  end
end

-- A new slot of `scope`, maturing at `matures`: its member name, the caller's claim.
-- Adds slot `name` (`<created ms>:<cost>:<scope>`) maturing at `matures` (a score string),
-- `:<k>` after the name should another hold it (two in one microsecond; a slot's rest).
local function add_slot(matures, name)
  local member, k = name, 0
  while redis.call('ZSCORE', rset, member) do
    k = k + 1
    member = name .. ':' .. k
  end
  redis.call('ZADD', rset, matures, member)
  return member
end

local function keep(matures, scope)
  local name = string.format('%.3f', now) .. ':' .. cost_text .. ':' .. scope
  if metered then -- what each bucket took: its tenant's given back should it never be
    local own = {} -- claimed, and a claim by another call of other costs takes the difference
    for i = 1, n do
      own[i] = string.format('%.17g', costs[i])
    end
    name = name .. ':m' .. table.concat(own, ',')
  end
  local member = add_slot(string.format('%.3f', matures), name)
  local last = redis.call('ZRANGE', rset, -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', rset, math.ceil(tonumber(last[2]) - now + life_ms) + 1000)
  return member
end

-- Late slots: matured, past their owner's time, not claimed. Their tokens were taken when
-- they were kept and their time has come: they are units any request of the bucket set may
-- use, one that holds a later slot of its own included (it moves up), and a costly slot
-- serves several cheaper requests (what is left of it stays, maturing when it did). Never
-- given back to a level: a level is a count, not a schedule (see "Kept slots"). Units of one
-- scope, the latest matured first (the shortest moves, which overlap the fewest: taken
-- earliest first, a slot offered to a caller as its standby went unused beside the older
-- one it moved instead), in each bucket as many as the request takes there (a metered
-- slot's tokens serve metered calls of other estimates: what each needs, the rest staying);
-- the rest from the buckets, granted only if they have it within `max_wait` (else nothing
-- of the pool is touched). Each bucket's moves are its own: the budget below is per bucket.
-- A slot used late moves a request from its time to now: every vendor window that starts
-- in between holds one more than the schedule gave it. While a bucket stays below empty the
-- schedule gives each window no more than rate x window, leaving the burst free: moves
-- whose spans ([its time, now)) overlap may together carry no more than the burst, less
-- what the bucket holds now, and no window is overrun. A bucket that stood above empty
-- since the slot's time (`above`) spent tokens of its own meanwhile, and a window there may
-- be fuller: 4 at once where a burst of 2 allowed 2. Below half its burst all along (`half`),
-- it leaves half the burst free; above it, none: such a slot is not moved (its tokens go
-- back to the tenant's buckets after `life`, as any slot nobody claims). The moves of the last `life` ms
-- are kept in `shifts` (member "<its time>:<u_1,...,u_n>:<now>:<k>", scored by now); a slot
-- whose move would not fit serves what fits, or waits for its time to pass (`life`). A slot
-- claimed late by its owner is a move too, which the others' must fit beside.
local pool = nil
if rset and due and not held and full == 0 then
  local late = redis.call('ZREVRANGEBYSCORE', rset, string.format('%.3f', now - owner_ms),
    string.format('%.3f', now - life_ms), 'WITHSCORES', 'LIMIT', 0, 64)
  local moved = nil -- {units, end} of the moves kept that may overlap these (units: per bucket)
  local got, used, scope, first = {}, {}, nil, nil -- got[i]: units of late slots bucket i takes
  for i = 1, n do
    got[i] = 0
  end
  for k = 1, #late, 2 do
    local created, taken, s, tcosts = parse(late[k])
    local at = tonumber(late[k + 1])
    if created <= void_before then
      redis.call('ZREM', rset, late[k])
    elseif scope == nil or s == scope then
      local last = n -- the buckets the slot took from: a `t` slot, the tenant's
      if s == 't' then
        last = tenants
      end
      if not moved then
        redis.call('ZREMRANGEBYSCORE', shifts, '-inf', string.format('(%.3f', now - life_ms))
        moved = {}
        local live = redis.call('ZRANGEBYSCORE', shifts, '-inf', '+inf', 'WITHSCORES')
        for q = 1, #live, 2 do
          moved[#moved + 1] = {units_of(string.match(live[q], '^[^:]+:([^:]+):')), tonumber(live[q + 1])}
        end
      end
      -- Per bucket: what the slot holds, what the request still needs, and what a move fits.
      local takes, any, done = {}, false, true
      for i = last + 1, n do -- (a `t` slot holds nothing in the vendor's buckets)
        takes[i] = 0
      end
      for i = 1, last do
        local room = bursts[i] - math.max(levels[i], 0)
        if half[i] >= at then
          room = 0
        elseif above[i] >= at then
          room = math.min(room, bursts[i] / 2)
        end
        local overlap = got[i] -- this call's moves so far all overlap this one (they end now)
        for _, mv in ipairs(moved) do
          if mv[2] > at then -- a span ending after this slot's time overlaps its own
            overlap = overlap + (mv[1][i] or mv[1][0] or 0)
          end
        end
        local t = math.max(math.min(tcosts and tcosts[i] or taken, costs[i] - got[i], room - overlap), 0)
        takes[i] = t
        any = any or t > 0
      end
      if any then -- (else its move would not fit: a later slot's may)
        scope = scope or s
        first = first or at - now
        used[#used + 1] = {late[k], late[k + 1], takes, last, taken, tcosts}
        for i = 1, last do
          got[i] = got[i] + takes[i]
          done = done and got[i] >= costs[i]
        end
        if done then
          break
        end
      end
    end
  end
  if scope then
    local need, takes = first, {}
    for i = 1, n do
      takes[i] = costs[i] - got[i]
      if takes[i] > 0 then
        need = math.max(need, (takes[i] - levels[i]) / rates[i])
      end
    end
    if need <= max_wait then
      pool = {used = used, takes = takes, wait = need}
    end
  end
end

local function num(x) -- a cost in a member's name: whole numbers as such, else exactly
  if x == math.floor(x) then
    return string.format('%d', x)
  end
  return string.format('%.17g', x)
end

-- A slot of time `at` (a score string) used by `units` of a request that goes at `ends` (ms;
-- now, or when the bucket's rest matures): a move the later ones must fit beside.
local function record_move(at, units, tag, ends) -- (units: per bucket)
  local at_now = string.format('%.3f', ends)
  local text = {}
  for i = 1, n do
    text[i] = num(units[i])
  end
  redis.call('ZADD', shifts, at_now, at .. ':' .. table.concat(text, ',') .. ':' .. at_now .. ':' .. tag)
  redis.call('PEXPIRE', shifts, math.ceil(life_ms) + 1000)
end

-- Standby. A precise retrier sleeps until its slot: while it does, nobody asks when a slot
-- whose owner is gone matures, and that slot's tokens stand idle. A slot whose owner's
-- connection closed (leave.lua: likely never claimed) is offered to one refusal whose own
-- slot matures later: its hint is that slot's time (plus `standby` ms, the owner's head
-- start), when it asks and, the slot unclaimed, takes it (moves up, "Late slots"); claimed,
-- it is refused with its own slot again. Only slots left behind: a hint that is a guess
-- costs a refusal, and precise retriers whose owners come back would pay it every time.
-- The offer is kept with the caller's own slot (`offers`: its member -> the slot offered):
-- should that caller leave too (leave.lua), the slot is offered again. A refusal beyond the
-- horizon keeps no slot of its own: it is offered one left behind all the same (a queue full
-- of slots whose owners gave up would send every caller past them, and they would stand
-- idle), and its claim is `~<the slot offered>`, which claims nothing but is left with its
-- connection (leave.lua) like any other.
-- The head start is at most half the schedule's interval (the binding bucket's cost / rate):
-- taken later, the slot's move would overlap the next slots' owners' few ms of lateness
-- (each a move too), and at a small burst it would not fit (at 95/s burst 1 a 50 ms head
-- start left a fifth of the quota unused). Only a slot at least STANDBY_GAIN ms, or ten
-- intervals if less, before the caller's own is offered: many clients open a connection per
-- call and come back for their slot on a new one, and the refusal a standby may cost them
-- (a retry of an SDK's few) is worth that much gained, not less.
local STANDBY_GAIN = 1000
local function schedule_interval() -- ms between two slots of the binding bucket, and that bucket
  local interval, slowest = 0, 0 -- (0: no bucket takes anything)
  for i = 1, n do
    if costs[i] / rates[i] > interval then
      interval, slowest = costs[i] / rates[i], i
    end
  end
  return interval, slowest
end
local function standby(own, member) -- ms: when the caller of slot `member` (maturing at `own`) asks again
  local interval = schedule_interval()
  local head = math.min(math.max(standby_ms, owner_ms), interval / 2)
  local gain = math.min(STANDBY_GAIN, 10 * interval)
  for _ = 1, 4 do
    local found = redis.call('ZRANGEBYSCORE', left, string.format('(%.3f', now),
      string.format('(%.3f', own - gain - head), 'WITHSCORES', 'LIMIT', 0, 1)
    if not found[1] then
      break
    end
    redis.call('ZREM', left, found[1])
    if redis.call('ZSCORE', rset, found[1]) then -- (claimed meanwhile: gone from the slots)
      if member ~= '' then
        redis.call('HSET', offers, member, found[1])
        redis.call('PEXPIRE', offers, math.max(redis.call('PTTL', rset), 1))
      end
      return math.min(tonumber(found[2]) + head, own) - now, found[1]
    end
  end
  return own - now
end

local granted = 0
local hint = wait
local reserved, claimed = '', 0
if pool then
  -- Granted on late slots' units (and the rest from the buckets): the last slot used keeps
  -- what this request did not need. A slot of this caller's own, still ahead, is nobody's
  -- now: it is late from its maturity on, for whoever asks then.
  for k, slot in ipairs(pool.used) do
    local member, at, takes, last, taken, tcosts = slot[1], slot[2], slot[3], slot[4], slot[5], slot[6]
    redis.call('ZREM', rset, member)
    redis.call('ZREM', left, member)
    local rest, some, even = {}, false, true -- what it holds on: the same in every bucket, or not
    for i = 1, n do
      rest[i] = i <= last and (tcosts and tcosts[i] or taken) - takes[i] or 0
      some = some or rest[i] > 0
      even = even and (i > last or rest[i] == rest[1])
    end
    local created, scope = string.match(member, '^([^:]+):[^:]+:([at])')
    if some and even and not tcosts then
      add_slot(at, created .. ':' .. num(rest[1]) .. ':' .. scope)
    elseif some then
      local text = {}
      for i = 1, n do
        text[i] = num(rest[i])
      end
      add_slot(at, created .. ':' .. num(rest[n]) .. ':' .. scope .. ':m' .. table.concat(text, ','))
    end
    record_move(at, takes, k, now + math.max(pool.wait, 0))
  end
  for i = 1, n do
    levels[i] = levels[i] - pool.takes[i]
  end
  write_levels()
  local own = mine ~= '' and redis.call('ZSCORE', rset, mine)
  if own then -- nobody's now: late from its maturity, and a standby for a later refusal
    own = string.format('%.3f', tonumber(own) - owner_ms)
    redis.call('ZADD', rset, own, mine)
    redis.call('ZADD', left, own, mine)
    redis.call('PEXPIRE', left, math.max(redis.call('PTTL', rset), 1))
  end
  granted, claimed = 1, 1
  -- Granted at most half the schedule's interval before now, as the replica's pacer sees it
  -- (pacing.py): a short move (a standby's head start, a few ms of lateness) shifts the
  -- replica's later writes as a late owner's claim does, and the burst stays free for the
  -- jitter of arrivals (at 95/s burst 1, moves that went at once, one after another, used it
  -- all, and a request a few ms slower than the next made a window of 97); a longer move
  -- was fitted beside the others', and as a lag it would hold every later write back as long
  -- (at 2/s burst 1 up to a second, until it ran past pacing.MAX_WAIT and they bunched).
  wait = math.max(pool.wait, -schedule_interval() / 2)
  hint = wait
  take_leases(now + math.max(pool.wait, 0))
  count_grant()
elseif held then
  -- A kept slot, matured: its tokens were taken when it was kept; one kept on the
  -- tenant's buckets alone (`t`: they bound) takes the vendor-side ones now. Claimed
  -- late, it was granted when it matured (the wait is negative): the replica's pacer
  -- then writes the ones after it no closer (pacing.py), however late its owner came.
  local _, _, scope, tcosts = parse(held)
  local function adjust(last) -- a metered slot: this call's costs, not the slot's, are taken
    if tcosts then
      for i = 1, last do
        levels[i] = levels[i] - (costs[i] - (tcosts[i] or costs[i]))
      end
    end
  end
  local need = claim_wait
  if scope == 't' then
    need = math.max(need, 0, vendor_wait)
  end
  wait, hint = need, need
  if full == 0 and need <= max_wait then
    granted, claimed = 1, 1
    redis.call('ZREM', rset, held)
    redis.call('ZREM', left, held)
    if need < 0 then -- claimed late: a move like a late slot's, which the others' must fit beside
      record_move(string.format('%.3f', now + need), costs, 'h', now)
    end
    if scope == 't' then
      adjust(tenants)
      take(tenants + 1, n)
      write_levels()
    elseif tcosts then
      adjust(n)
      write_levels()
    elseif refunded then
      write_levels()
    end
    take_leases(now + need)
    count_grant()
  elseif full == 0 and scope == 't' and need <= horizon_ms then
    -- The vendor side has no room yet: the slot is kept on every bucket now, this caller's.
    redis.call('ZREM', rset, held)
    adjust(tenants)
    take(tenants + 1, n)
    write_levels()
    reserved = keep(now + need, 'a')
    count_grant()
  else
    -- A lease set is full (or the vendor side too far off): refused, the caller's slot kept.
    if held == claim then
      reserved = claim
    end
    if refunded then
      write_levels()
    end
  end
elseif early then
  -- This caller's slot is still ahead: refused with it again, never a new one.
  wait, hint, reserved = early, standby(now + early, claim), claim
  if refunded then
    write_levels()
  end
elseif gate_ok and wait <= (share and not credit_used and math.min(max_wait, share.horizon) or max_wait)
    and full == 0 then
  granted = 1
  if queue then -- its slowest bucket overflowed: the queue's hints ran past it ("Deferral queue")
    local _, slowest = schedule_interval()
    restart = slowest > 0 and overflowed[slowest]
  end
  take(1, n)
  write_levels()
  take_leases(now + wait)
  count_grant()
  if share then
    share_granted(wait)
    for i = 1, share.g - 1 do -- its own limit (or its endpoint's) holds its next: it waits on that
      if levels[i] < costs[i] then
        share_leaves()
        break
      end
    end
  end
elseif rset and gate_ok and full == 0 and wait <= horizon_ms then
  -- Refused, the slot kept: taken as a hold's, claimed when the caller comes back. When
  -- the tenant's own buckets bind, only they are taken now: a vendor-side token taken
  -- now would stand idle until the tenant's bucket lets the request go, and meanwhile
  -- hold back every other tenant's requests.
  if binding <= tenants then
    take(1, tenants)
    write_levels()
    reserved = keep(now + wait, 't')
  else
    take(1, n)
    write_levels()
    reserved = keep(now + wait, 'a')
  end
  hint = standby(now + wait, reserved)
  count_grant()
  if share then -- its turn, taken; it waits for it, as a tenant refused does
    share_load()
    share.V = share.V or share.F
    share_granted(wait)
    share.F = share.F + share.cost / share.w
    share_waits(wait, true)
  end
else
  if refunded then
    write_levels()
  end
  if share and not gate_ok then -- refused by the schedule: its turn, on the vendor's quota
    if gate_wait > wait or binding == 0 then
      wait = math.max(wait, gate_wait)
      binding = share.g
    end
    hint = wait
  end
  if full ~= 0 then
    -- How long the set's oldest lease has been out (its score is when it expires): when
    -- the next slot is likely free (concurrency.py), not a fixed second.
    local oldest = redis.call('ZRANGE', KEYS[n + full], 0, 0, 'WITHSCORES')
    hint = math.max(0, now - (tonumber(oldest[2]) - lease_life))
  end
  if queue and full == 0 then
    local step = costs[binding] / rates[binding]
    if share and gate_step and not gate_ok then -- (its turn under its share: its fair interval)
      step = gate_step
    end
    local tail = tonumber(redis.call('GET', queue) or '0') - now
    if tail + step > hint then
      hint = tail + step
    end
    redis.call('SET', queue, string.format('%.3f', now + hint), 'PX', math.ceil(hint) + 1000)
  end
  if rset and not share and full == 0 then -- beyond the horizon: a slot left behind may be its
    local offer, offered = standby(now + hint, '')
    if offered then
      hint, reserved = offer, '~' .. offered
    end
  end
  if share and full == 0 and (not gate_ok or binding >= share.g) then
    share_waits(hint, false)
  elseif share and full == 0 then
    share_leaves()
  end
end
if share and sh.dirty then -- the schedule's hash, in `flush` with the other writes
  put(share.hash, 'x', sh.x and string.format('%.3f', sh.x) or '')
  for i = 1, share.k do
    put(share.hash, 'w' .. i, string.format('%.6f', math.max(sh.w[i], 0)))
    put(share.hash, 'b' .. i, string.format('%.3f', sh.b[i]))
    put(share.hash, 'c' .. i, string.format('%.6f', sh.cr[i]))
    put(share.hash, 'u' .. i, sh.u[i] and string.format('%.3f', sh.u[i]) or '')
  end
  own[share.hash] = 60000
end

flush()
if restart then -- (after the writes: a script's first write lets the rest past a full Redis' OOM)
  redis.call('DEL', queue)
end

local ttl = 0
if state then
  if found_lost == 1 then
    -- `lost` must outlive the refill from below empty of every bucket it restarts.
    local refill = 0
    for i = 1, n do
      refill = math.max(refill, bursts[i] / rates[i])
    end
    local keep = math.ceil(debt + refill) + 1000
    if redis.call('PTTL', state) < keep then
      redis.call('PEXPIRE', state, keep)
    end
  end
  if found_lost == 1 or not state_ttl then
    state_ttl = redis.call('PTTL', state)
  end
  ttl = math.max(state_ttl, 0)
end

local out = {tostring(granted), string.format('%.3f', wait), tostring(binding), string.format('%.3f', hint),
  tostring(seq), tostring(found_lost), tostring(full), tostring(ttl)}
for i = 1, n do
  out[8 + i] = string.format('%.6f', levels[i])
end
for j = 1, m do
  out[8 + n + j] = tostring(inflight[j])
end
out[9 + n + m] = reserved
out[10 + n + m] = tostring(claimed)
return out
