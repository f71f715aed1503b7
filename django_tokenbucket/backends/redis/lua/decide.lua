-- django_tokenbucket: one atomic decision over one or more limits (RedisBackend).
--
-- A port of algorithms.token_bucket, algorithms.fixed_window and backends.base.decide_all.
-- Python's integers are unbounded and Lua's numbers are IEEE doubles, so the script has
-- two paths with the same results:
--
-- * the common path: one limit, one key, every input below 2^53, in plain double
--   arithmetic. Integer sums, differences and products of doubles are exact while the
--   true result is below 2^53, and rounding is monotonic, so a result that reads below
--   2^53 was exact: each step that could leave the range is checked, and the first one
--   that does sends the call to the general path (nothing has been written yet).
-- * the general path: any number of limits, any magnitude, through the exact helpers
--   of bignum.lua, which the backend joins in below (one script, one SHA). Reaching it
--   only when needed spares the common call the making of its ~30 functions.
--
-- tests/test_redis.py replays generated traces through this script and through Python
-- and requires identical decisions, values, waits and stored states, on both paths.
--
-- KEYS: the state key of every distinct (name, key) row of the call.
-- ARGV[1]: now in microseconds (a decimal integer), or "-" for Redis' TIME.
-- ARGV[2]: MessagePack integers apply (1 to consume, 0 only to read), min_ttl_ms,
--          max_ttl_ms, skew: algorithms.CLOCK_SKEW_TOLERANCE (a clock up to this far
--          behind the stored time lags another host's: it decides at the stored time,
--          and its non-zero waits are longer by the lag).
-- ARGV[2 + i]: request i, MessagePack: key index, count, kind (its code in
--          algorithms.ALGORITHMS: "t" token bucket, "f" fixed window), rate, period,
--          capacity, lowest (nil when reservations are uncapped), fresh value, fresh ts.
--          Every number is an integer of at most 2^53 in magnitude (LimitConfig's
--          bounds), which a double holds exactly.
-- Stored value: "<value> <ts>" (decimal integers), with a TTL.
-- Reply: from the common path, the integers now, allowed (1/0), value, retry_after (0
--        for None) and full_after; from the general path, whose numbers may pass 2^53,
--        one string, "<now>" then for each request " <allowed> <value> <retry_after>
--        <full_after>": allowed "1"/"0", "-" for a None retry_after.
-- Few arguments: Redis refuses more than 10 from a connection that has not
-- authenticated yet (it would not say NOAUTH), and cmsgpack reads nine integers faster
-- than Lua parses two of them from text.

local LIMIT = 9007199254740992       -- 2^53: plain numbers hold |x| < LIMIT exactly
local fmod = math.fmod               -- exact for doubles, unlike Lua 5.1's % operator
local tonumber = tonumber

local ok_header, apply, min_ttl_ms, max_ttl_ms, skew = pcall(cmsgpack.unpack, ARGV[2] or "")
if not ok_header or type(skew) ~= "number" or (apply ~= 0 and apply ~= 1) then
  return redis.error_reply("django_tokenbucket: malformed header: " .. tostring(ARGV[2]))
end
apply = apply == 1
local time_now
if ARGV[1] == "-" then
  local t = redis.call("TIME")
  time_now = tonumber(t[1]) * 1000000 + tonumber(t[2]) -- below 2^53 until the year 2255
end

-- The common path ---------------------------------------------------------------------
--
-- One limit, one key. Written inline, without functions: making a Lua function costs
-- as much as several arithmetic steps, and this runs on every call. Each step that
-- could leave the exact range is checked (``x < LIMIT and x > -LIMIT``); the first one
-- that does ``break``s out of the block to the general path, before anything is written.

if #ARGV == 3 and #KEYS == 1 then
  repeat
    local now = time_now or tonumber(ARGV[1])
    if now == nil or now >= LIMIT or now <= -LIMIT then break end
    local ok, key_index, count, kind, rate, period, capacity, lowest, fresh_value, fresh_ts =
      pcall(cmsgpack.unpack, ARGV[3])
    -- The general path checks the arguments, and takes what is 2^53 exactly.
    if not ok or key_index ~= 1 or type(fresh_ts) ~= "number" or count >= LIMIT or count <= -LIMIT
        or rate >= LIMIT or rate < 1 or period >= LIMIT or period < 1 or capacity >= LIMIT
        or (lowest ~= nil and lowest <= -LIMIT)
        or fresh_value >= LIMIT or fresh_value <= -LIMIT or fresh_ts >= LIMIT or fresh_ts <= -LIMIT then
      break
    end

    local raw = redis.call("GET", KEYS[1])
    local value, ts = fresh_value, fresh_ts
    if raw then
      local v, t = string.match(raw, "^(%-?%d+) (%-?%d+)$")
      value, ts = tonumber(v), tonumber(t) -- nil when unreadable: the general path says so
      if value == nil or value >= LIMIT or value <= -LIMIT or ts >= LIMIT or ts <= -LIMIT then break end
    end

    -- algorithms._lagging_clock_time: up to the tolerance behind the stored time, decide at it.
    local lag = ts - now
    if lag >= LIMIT or lag <= -LIMIT then break end
    local at = now
    if lag > 0 and lag <= skew then at = ts end
    local back = at < ts

    -- allowed, the value reported, the state to store (nil: none), and what the waits
    -- start from: the value ``from`` and, for a token bucket, its time ``from_ts``.
    local allowed, v, state_value, state_ts, from, from_ts
    -- ``retry_target``: the value retry_after waits for (nil: no wait to report).
    local retry_target
    -- A fixed window's waits count from the start of its window, ``into`` ago.
    local into
    if kind == "t" then
      -- algorithms.token_bucket
      local since = ts
      if back then since = at end
      local stored = value
      if stored > capacity then stored = capacity end
      local elapsed = at - since
      local deficit = capacity - stored
      if elapsed >= LIMIT or deficit >= LIMIT then break end
      -- stored + (rate * elapsed) // period >= capacity <=> rate * elapsed >= deficit * period.
      -- Products that round apart are ordered as the exact ones are, so a fresh or long
      -- idle bucket (a product far past 2^53) is known full without them being exact.
      local gained, needed = rate * elapsed, deficit * period
      local vts
      if gained > needed or (gained == needed and gained < LIMIT) then
        v, vts = capacity, at
      elseif gained < needed and gained < LIMIT then
        local rest = fmod(gained, period)
        v = stored + (gained - rest) / period
        -- Keep the refill phase: date the value back by the time that earned the rest.
        vts = at - (rest - fmod(rest, rate)) / rate
        if vts <= -LIMIT then break end
      else
        break
      end
      local after = v - count -- a refund's count is negative
      if after >= LIMIT or after <= -LIMIT then break end
      if lowest == nil or after >= lowest then
        allowed, v, state_value, state_ts, from, from_ts = true, after, after, vts, after, vts
        if after < 0 then retry_target = 0 end
      else
        -- Measured from the stored state, not the re-dated one, so the wait is exact.
        allowed, from, from_ts, retry_target = false, stored, since, count + lowest
        if back then state_value, state_ts = stored, at end
      end
    elseif kind == "f" then
      -- algorithms.fixed_window; fresh_ts is where its windows start, modulo period.
      local since_phase = at - fresh_ts
      if since_phase >= LIMIT or since_phase <= -LIMIT then break end
      into = fmod(since_phase, period)
      if into < 0 then into = into + period end
      local window_start = at - into
      if window_start <= -LIMIT then break end
      local windows = 0
      if window_start > ts then
        local gap = window_start - ts
        if gap >= LIMIT then break end
        local r = fmod(gap, period)
        windows = (gap - r) / period
        if r > 0 then windows = windows + 1 end
      end
      local missing = capacity - value
      if missing <= 0 then
        v = capacity
      else
        if missing >= LIMIT then break end
        -- A rounded product at or past the exact ``missing`` means the exact one is too.
        local credit = windows * rate
        if credit >= missing then v = capacity else v = value + credit end
      end
      local after = v - count
      if after >= LIMIT or after <= -LIMIT then break end
      if lowest == nil or after >= lowest then
        allowed, v, state_value, state_ts, from = true, after, after, window_start, after
        if after < 0 then retry_target = 0 end
      else
        allowed, from, retry_target = false, v, count + lowest
        if back then
          state_value, state_ts = value, window_start
          if value > capacity then state_value = capacity end
        end
      end
    else
      break
    end

    -- The waits until the value reaches retry_target and the capacity, as
    -- time_to_reach computes them, without a sum past 2^53 for a long wait.
    local retry, full = nil, 0
    local gone = false -- a wait that would leave the range
    for pass = 1, 2 do
      local target = capacity
      if pass == 1 then target = retry_target end
      local wait = nil
      if target ~= nil then
        if from >= target then
          wait = 0
        elseif kind == "t" then
          -- from_ts + ceil((target - from) * period / rate) - at
          local deficit, behind = (target - from) * period, at - from_ts
          if deficit >= LIMIT or behind >= LIMIT then gone = true; break end
          local r = fmod(deficit, rate)
          wait = (deficit - r) / rate - behind
          if r > 0 then wait = wait + 1 end
        else
          -- window_start + ceil((target - from) / rate) * period - at
          local missing = target - from
          if missing >= LIMIT then gone = true; break end
          local r = fmod(missing, rate)
          local windows = (missing - r) / rate
          if r > 0 then windows = windows + 1 end
          local span = windows * period
          if span >= LIMIT then gone = true; break end
          wait = span - into
        end
      end
      if pass == 1 then retry = wait else full = wait end
    end
    if gone then break end
    if at ~= now then
      -- Waits on the caller's clock, which must run ``lag`` longer to see them end.
      if retry ~= nil and retry ~= 0 then retry = retry + lag end
      if full ~= 0 then full = full + lag end
      if (retry ~= nil and retry >= LIMIT) or full >= LIMIT then break end
    end

    -- Written: an allowed call's state when it changed (or the key is new), a denied
    -- one's only when it is a rebase after a clock that went backwards.
    if apply and state_value ~= nil and (not allowed or not raw or state_value ~= value or state_ts ~= ts) then
      -- Expire when the bucket reads as full (fresh) again: an absent key means exactly that.
      local r = fmod(full, 1000)
      local ttl = (full - r) / 1000
      if r > 0 then ttl = ttl + 1 end
      if ttl < min_ttl_ms then ttl = min_ttl_ms end
      if ttl > max_ttl_ms then ttl = max_ttl_ms end
      redis.call("SET", KEYS[1], string.format("%d %d", state_value, state_ts), "PX", string.format("%d", ttl))
    end
    -- Integers, which Redis replies as such: no formatting here, no parsing in Python.
    -- A retry_after is there when denied or in debt (value < 0): 0 stands for None.
    return { now, allowed and 1 or 0, v, retry or 0, full }
  until true
end

-- The general path --------------------------------------------------------------------

--[[ bignum.lua ]]

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

local now = time_now or parse(ARGV[1])
local n = #ARGV - 2
local loaded = {}
for k = 1, #KEYS do
  local raw = redis.call("GET", KEYS[k])
  if raw then
    local v, t = string.match(raw, "^(%-?%d+) (%-?%d+)$")
    if not v then return redis.error_reply("django_tokenbucket: unreadable state in " .. KEYS[k]) end
    loaded[k] = { parse(v), parse(t) }
  end
end

local requests = {}
local function integer(x) return type(x) == "number" and fmod(x, 1) == 0 and x <= LIMIT and x >= -LIMIT end
for i = 1, n do
  local ok, key, count, kind, rate, period, capacity, lowest, fresh_value, fresh_ts = pcall(cmsgpack.unpack, ARGV[i + 2])
  if not (ok and integer(key) and key >= 1 and key <= #KEYS and integer(count) and (kind == "t" or kind == "f")
      and integer(rate) and rate > 0 and integer(period) and period > 0 and integer(capacity)
      and (lowest == nil or integer(lowest)) and integer(fresh_value) and integer(fresh_ts)) then
    return malformed("request " .. i, ARGV[i + 2])
  end
  -- One table per request, which is also the limit its algorithm reads (fewer tables
  -- to make and collect on every call).
  requests[i] = {
    key = key,
    algorithm = kind == "f" and fixed_window or token_bucket,
    rate = rate,
    period = period,
    capacity = capacity,
    -- A fresh fixed window starts on its phase, so its fresh ts is the phase of the windows.
    phase = fresh_ts,
    fresh_value = fresh_value,
    lowest = lowest,
    count = count,
  }
end

local function decide(request, state, count, lowest)
  local value, ts = request.fresh_value, request.phase
  if state then value, ts = state[1], state[2] end
  local lag = sub(ts, now)
  if cmp(lag, 0) <= 0 or cmp(lag, skew) > 0 then
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
  reply[i + 1] = (d[1] and "1 " or "0 ") .. tostr(d[2]) .. " " .. (d[3] ~= nil and tostr(d[3]) or "-") .. " " .. tostr(d[4])
end
return table.concat(reply, " ")
