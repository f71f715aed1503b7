-- django_tokenbucket: one atomic decision over one or more limits (RedisBackend).
--
-- This is a line-for-line port of algorithms.token_bucket, algorithms.fixed_window and
-- backends.base.decide_all. Python's integers are unbounded and Lua's numbers are IEEE
-- doubles, so every operation goes through the exact helpers below: an integer stays a
-- plain number while |x| <= 2^53 and becomes a small bignum only when a product or a
-- sum leaves that range (fresh buckets, long idle times, huge configs, deep debts).
-- tests/test_redis.py replays generated traces through this script and through
-- Python and requires identical decisions, values, waits and stored states.
--
-- KEYS: the state key of every distinct (name, key) row of the call.
-- ARGV[1]: "<now> <apply> <min_ttl_ms> <max_ttl_ms>": now in microseconds ("-" = Redis
--          TIME), apply "1" to consume or "0" only to read.
-- ARGV[2..n+1]: one request each, "<key index> <count> <kind> <rate> <period> <capacity>
--          <lowest> <fresh value> <fresh ts>": kind "t" token bucket or "f" fixed window,
--          lowest "-" when reservations are uncapped.
-- Stored value: "<value> <ts>" (decimal integers), with a TTL.
-- Reply: one string, "<now>" then for each request " <allowed> <value> <retry_after>
--        <full_after> <state value> <state ts>": allowed "1"/"0", "-" for a None
--        retry_after and for no state to store.
-- One argument per request and a one-string reply: redis-py packs every argument and
-- parses every reply element in Python, at a few microseconds each.

local B = 16777216                   -- 2^24: limb base of the bignums
local LIMIT = 9007199254740992       -- 2^53: plain numbers hold |x| <= LIMIT exactly
local fmod = math.fmod               -- exact for doubles, unlike Lua 5.1's % operator
local type = type

-- Magnitudes: arrays of base-2^24 limbs, least significant first, no leading zeros.

local function isbig(x) return type(x) == "table" end

local function mag_from_plain(m)
  local t, i = {}, 0
  while m > 0 do
    local r = fmod(m, B)
    i = i + 1
    t[i] = r
    m = (m - r) / B
  end
  return t
end

local function mag_trim(a)
  local n = #a
  while n > 0 and a[n] == 0 do
    a[n] = nil
    n = n - 1
  end
  return a
end

local function mag_cmp(a, b)
  if #a ~= #b then return #a < #b and -1 or 1 end
  for i = #a, 1, -1 do
    if a[i] ~= b[i] then return a[i] < b[i] and -1 or 1 end
  end
  return 0
end

local function mag_add(a, b)
  local r, carry = {}, 0
  for i = 1, math.max(#a, #b) do
    local s = (a[i] or 0) + (b[i] or 0) + carry
    if s >= B then r[i] = s - B; carry = 1 else r[i] = s; carry = 0 end
  end
  if carry > 0 then r[#r + 1] = carry end
  return r
end

local function mag_sub(a, b) -- requires a >= b
  local r, borrow = {}, 0
  for i = 1, #a do
    local s = a[i] - (b[i] or 0) - borrow
    if s < 0 then r[i] = s + B; borrow = 1 else r[i] = s; borrow = 0 end
  end
  return mag_trim(r)
end

local function mag_mul(a, b)
  local r, na, nb = {}, #a, #b
  for i = 1, na + nb do r[i] = 0 end
  for i = 1, na do
    local carry, ai = 0, a[i]
    for j = 1, nb do
      local t = r[i + j - 1] + ai * b[j] + carry -- < 2^49: exact
      local lo = fmod(t, B)
      r[i + j - 1] = lo
      carry = (t - lo) / B
    end
    local k = i + nb
    while carry > 0 do
      local t = r[k] + carry
      local lo = fmod(t, B)
      r[k] = lo
      carry = (t - lo) / B
      k = k + 1
    end
  end
  return mag_trim(r)
end

-- Divide a magnitude by a plain 1 <= d <= 2^53; return the quotient and the remainder.
local function mag_divmod(a, d)
  local q, r = {}, 0
  if d * B <= LIMIT then
    -- Short division: r * 2^24 + limb stays exact.
    for i = #a, 1, -1 do
      local t = r * B + a[i]
      r = fmod(t, d)
      q[i] = (t - r) / d
    end
    return mag_trim(q), r
  end
  -- Bit by bit, never forming 2r (which could pass 2^53): 2r + bit >= d <=> r >= d - r - bit.
  for i = #a, 1, -1 do
    local limb, qlimb, p = a[i], 0, B
    for _ = 1, 24 do
      p = p / 2
      local b = 0
      if limb >= p then b = 1; limb = limb - p end
      local e = d - r
      if r >= e - b then
        r = r - e + b
        qlimb = qlimb + p
      else
        r = r + r + b
      end
    end
    q[i] = qlimb
  end
  return mag_trim(q), r
end

-- Integers: a plain number when |x| <= 2^53, else a magnitude with a .neg flag.

local function norm(neg, mag)
  local n = #mag
  if n <= 2 or (n == 3 and (mag[3] < 32 or (mag[3] == 32 and mag[2] == 0 and mag[1] == 0))) then
    local v = 0
    for i = n, 1, -1 do v = v * B + mag[i] end
    if neg and v ~= 0 then v = -v end
    return v
  end
  mag.neg = neg
  return mag
end

local function split(x) -- -> neg, magnitude (never modified by the callers)
  if isbig(x) then return x.neg, x end
  if x < 0 then return true, mag_from_plain(-x) end
  return false, mag_from_plain(x)
end

local function add(a, b)
  if type(a) == "number" and type(b) == "number" then
    -- Exact when the true sum is below 2^53; rounding is monotonic, so a sum of
    -- 2^53 or more never rounds below it.
    local s = a + b
    if s < LIMIT and s > -LIMIT then return s end
  end
  local an, am = split(a)
  local bn, bm = split(b)
  if an == bn then return norm(an, mag_add(am, bm)) end
  local c = mag_cmp(am, bm)
  if c == 0 then return 0 end
  if c > 0 then return norm(an, mag_sub(am, bm)) end
  return norm(bn, mag_sub(bm, am))
end

local function neg(a)
  if type(a) == "number" then return -a end
  local r = {}
  for i = 1, #a do r[i] = a[i] end
  r.neg = not a.neg
  return r
end

local function sub(a, b)
  if type(a) == "number" and type(b) == "number" then
    local s = a - b
    if s < LIMIT and s > -LIMIT then return s end
  end
  return add(a, neg(b))
end

local function mul(a, b)
  if type(a) == "number" and type(b) == "number" then
    local p = a * b
    if p < LIMIT and p > -LIMIT then return p end
  end
  local an, am = split(a)
  local bn, bm = split(b)
  if #am == 0 or #bm == 0 then return 0 end
  return norm(an ~= bn, mag_mul(am, bm))
end

local function cmp(a, b)
  if type(a) == "number" and type(b) == "number" then
    if a < b then return -1 elseif a > b then return 1 end
    return 0
  end
  local d = sub(a, b)
  if isbig(d) then return d.neg and -1 or 1 end
  if d < 0 then return -1 elseif d > 0 then return 1 end
  return 0
end

-- Python's divmod by a plain positive d: a = q * d + r with 0 <= r < d.
local function divmod(a, d)
  if type(a) == "number" then
    local r = fmod(a, d) -- exact, with the sign of a
    local q = (a - r) / d -- an exact division of an exact difference
    if r < 0 then r = r + d; q = q - 1 end
    return q, r
  end
  local qm, r = mag_divmod(a, d)
  if a.neg and r > 0 then return norm(true, mag_add(qm, { 1 })), d - r end
  return norm(a.neg, qm), r
end

local function floordiv(a, d)
  local q = divmod(a, d)
  return q
end

local function ceildiv(a, d) return neg(floordiv(neg(a), d)) end

-- a * b >= c * d for non-negative a, b, c, d, without a bignum unless it is a near tie.
-- Rounding is monotonic, so rounded products that differ order the exact ones the same
-- way; only equal rounded products need the exact comparison.
local function prod_ge(a, b, c, d)
  if not (isbig(a) or isbig(b) or isbig(c) or isbig(d)) then
    local x, y = a * b, c * d
    if x ~= y then return x > y end
    if x < LIMIT then return true end -- equal and exact
  end
  return cmp(mul(a, b), mul(c, d)) >= 0
end

local function parse(s)
  -- tonumber rounds correctly and monotonically: a result below 2^53 is exact, and
  -- 2^53 itself (the TTL cap, sent on every call) is when it prints back unchanged.
  local n = tonumber(s)
  if n and n < LIMIT and n > -LIMIT then return n end
  if (n == LIMIT or n == -LIMIT) and string.format("%.0f", n) == s then return n end
  local negative, digits = string.match(s, "^(%-?)(%d+)$")
  if not digits then return error("django_tokenbucket: not an integer: " .. tostring(s)) end
  local x = 0
  local head = #digits % 7
  if head > 0 then x = tonumber(string.sub(digits, 1, head)) end
  for i = head + 1, #digits, 7 do
    x = add(mul(x, 10000000), tonumber(string.sub(digits, i, i + 6)))
  end
  if negative == "-" then return neg(x) end
  return x
end

local function tostr(x)
  if not isbig(x) then
    if x == 0 then return "0" end
    return string.format("%.0f", x) -- exact for integers below 2^53
  end
  local m = {}
  for i = 1, #x do m[i] = x[i] end
  local parts = {}
  while #m > 0 do
    local r
    m, r = mag_divmod(m, 10000000)
    parts[#parts + 1] = r
  end
  local out = { x.neg and "-" or "", string.format("%d", parts[#parts]) }
  for i = #parts - 1, 1, -1 do out[#out + 1] = string.format("%07d", parts[i]) end
  return table.concat(out)
end

-- The algorithms: see algorithms.py for the reasoning behind each step.

-- When the value reaches ``target`` refilling from ``from_value`` at ``from_ts``, relative to now.
-- (Top-level functions rather than closures inside the algorithms: one closure fewer to
-- make and collect per decision.)
local function bucket_time_to_reach(L, now, target, from_value, from_ts)
  if cmp(from_value, target) >= 0 then return 0 end
  return sub(add(from_ts, ceildiv(mul(sub(target, from_value), L.period), L.rate)), now)
end

local function token_bucket(value, ts, now, count, lowest, L)
  local back = cmp(now, ts) < 0
  local since = back and now or ts
  local capacity = L.capacity
  local stored = value
  if cmp(stored, capacity) > 0 then stored = capacity end
  local elapsed = sub(now, since)
  local v, vts
  -- stored + (rate * elapsed) // period >= capacity  <=>  rate * elapsed >= (capacity - stored) * period:
  -- decided without dividing, and without a bignum for a fresh or long idle bucket.
  if prod_ge(L.rate, elapsed, sub(capacity, stored), L.period) then
    v, vts = capacity, now
  else
    local credited, rest = divmod(mul(L.rate, elapsed), L.period)
    v = add(stored, credited)
    vts = sub(now, floordiv(rest, L.rate))
  end

  local after = sub(v, count)
  if lowest == nil or cmp(after, lowest) >= 0 then
    local retry = nil
    if cmp(after, 0) < 0 then retry = bucket_time_to_reach(L, now, 0, after, vts) end
    return { true, after, retry, bucket_time_to_reach(L, now, capacity, after, vts), after, vts }
  end
  local retry = bucket_time_to_reach(L, now, add(count, lowest), stored, since)
  local full = bucket_time_to_reach(L, now, capacity, stored, since)
  if back then return { false, v, retry, full, stored, now } end
  return { false, v, retry, full }
end

-- When the value reaches ``target`` from ``from_value``, one rate per window from window_start.
local function window_time_to_reach(L, now, window_start, target, from_value)
  if cmp(from_value, target) >= 0 then return 0 end
  return sub(add(window_start, mul(ceildiv(sub(target, from_value), L.rate), L.period)), now)
end

local function fixed_window(value, ts, now, count, lowest, L)
  local back = cmp(now, ts) < 0
  local _, into = divmod(sub(now, L.phase), L.period)
  local window_start = sub(now, into)
  -- Window starts after the stored one: ceil((window_start - ts) / period), at least 0.
  local windows = 0
  if cmp(window_start, ts) > 0 then windows = ceildiv(sub(window_start, ts), L.period) end
  local capacity = L.capacity
  local v
  local missing = sub(capacity, value)
  if cmp(missing, 0) <= 0 or prod_ge(windows, L.rate, missing, 1) then
    v = capacity
  else
    v = add(value, mul(windows, L.rate))
  end

  local after = sub(v, count)
  if lowest == nil or cmp(after, lowest) >= 0 then
    local retry = nil
    if cmp(after, 0) < 0 then retry = window_time_to_reach(L, now, window_start, 0, after) end
    return { true, after, retry, window_time_to_reach(L, now, window_start, capacity, after), after, window_start }
  end
  local retry = window_time_to_reach(L, now, window_start, add(count, lowest), v)
  local full = window_time_to_reach(L, now, window_start, capacity, v)
  if back then
    local kept = value
    if cmp(kept, capacity) > 0 then kept = capacity end
    return { false, v, retry, full, kept, window_start }
  end
  return { false, v, retry, full }
end

-- decide_all: every request against the state as left by the ones before it.

local function malformed(what, arg)
  return redis.error_reply("django_tokenbucket: malformed " .. what .. ": " .. tostring(arg))
end

local now_arg, apply_arg, min_ttl_arg, max_ttl_arg = string.match(ARGV[1] or "", "^(%S+) ([01]) (%S+) (%S+)$")
if not now_arg then return malformed("header", ARGV[1]) end
local now
if now_arg ~= "-" then
  now = parse(now_arg)
else
  local t = redis.call("TIME")
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local apply = apply_arg == "1"
local min_ttl_ms = parse(min_ttl_arg)
local max_ttl_ms = parse(max_ttl_arg)
local n = #ARGV - 1

local loaded = {}
for k = 1, #KEYS do
  local raw = redis.call("GET", KEYS[k])
  if raw then
    local v, t = string.match(raw, "^(%-?%d+) (%-?%d+)$")
    if not v then return redis.error_reply("django_tokenbucket: unreadable state in " .. KEYS[k]) end
    loaded[k] = { parse(v), parse(t) }
  end
end

local REQUEST = "^(%d+) (%S+) ([tf]) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+)$"
local requests = {}
for i = 1, n do
  local key, count, kind, rate, period, capacity, lowest, fresh_value, fresh_ts = string.match(ARGV[i + 1], REQUEST)
  if not key then return malformed("request", ARGV[i + 1]) end
  -- One table per request, which is also the limit its algorithm reads (fewer tables
  -- to make and collect on every call).
  requests[i] = {
    key = tonumber(key),
    algorithm = kind == "f" and fixed_window or token_bucket,
    rate = parse(rate),
    period = parse(period),
    capacity = parse(capacity),
    -- A fresh fixed window starts on its phase, so its fresh ts is the phase of the windows.
    phase = parse(fresh_ts),
    fresh_value = parse(fresh_value),
    lowest = lowest ~= "-" and parse(lowest) or nil,
    count = parse(count),
  }
end

-- algorithms.CLOCK_SKEW_TOLERANCE: a clock up to this far behind the stored time lags
-- another host's; it decides at the stored time, and its non-zero waits are longer by the lag.
local CLOCK_SKEW_TOLERANCE = 5000000

local function decide(request, state, count, lowest)
  local value, ts = request.fresh_value, request.phase
  if state then value, ts = state[1], state[2] end
  local lag = sub(ts, now)
  if cmp(lag, 0) <= 0 or cmp(lag, CLOCK_SKEW_TOLERANCE) > 0 then
    return request.algorithm(value, ts, now, count, lowest, request)
  end
  local d = request.algorithm(value, ts, ts, count, lowest, request)
  if d[3] ~= nil and cmp(d[3], 0) ~= 0 then d[3] = add(d[3], lag) end
  if cmp(d[4], 0) ~= 0 then d[4] = add(d[4], lag) end
  return d
end

local current, full_after = {}, {}
for k, state in pairs(loaded) do current[k] = state end
local decisions, all_allowed = {}, true
for i, request in ipairs(requests) do
  local d = decide(request, current[request.key], request.count, request.lowest)
  decisions[i] = d
  if d[1] then
    current[request.key] = { d[5], d[6] }
    full_after[request.key] = d[4]
  else
    all_allowed = false
  end
end

local writes = {}
if all_allowed then
  for k, state in pairs(current) do
    local before = loaded[k]
    if not before or cmp(before[1], state[1]) ~= 0 or cmp(before[2], state[2]) ~= 0 then
      writes[k] = { state, full_after[k] }
    end
  end
else
  -- Nothing is consumed: an allowed-alone limit is reported as it stands, and only a
  -- rebase after a clock that went backwards is kept.
  for i, request in ipairs(requests) do
    local d = decisions[i]
    if d[1] then
      decisions[i] = decide(request, loaded[request.key], 0, 0)
    elseif d[5] ~= nil then
      writes[request.key] = { { d[5], d[6] }, d[4] }
    end
  end
end

if apply then
  for k, write in pairs(writes) do
    -- Expire when the bucket reads as full (fresh) again: an absent key means exactly that.
    local ttl = ceildiv(write[2], 1000)
    if cmp(ttl, min_ttl_ms) < 0 then ttl = min_ttl_ms end
    if cmp(ttl, max_ttl_ms) > 0 then ttl = max_ttl_ms end
    redis.call("SET", KEYS[k], tostr(write[1][1]) .. " " .. tostr(write[1][2]), "PX", tostr(ttl))
  end
end

local reply = { tostr(now) }
for i = 1, n do
  local d = decisions[i]
  reply[i + 1] = (d[1] and "1 " or "0 ") .. tostr(d[2]) .. " " .. (d[3] ~= nil and tostr(d[3]) or "-") .. " "
    .. tostr(d[4]) .. " " .. (d[5] ~= nil and tostr(d[5]) .. " " .. tostr(d[6]) or "- -")
end
return table.concat(reply, " ")
