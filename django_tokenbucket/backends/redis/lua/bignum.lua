-- django_tokenbucket: exact integers beyond 2^53 for decide.lua's general path.
--
-- Python's integers are unbounded and Lua's numbers are IEEE doubles. With these
-- helpers an integer stays a plain number while |x| <= 2^53 and becomes a small bignum
-- (base-2^24 limbs) only when a product or a sum leaves that range: fresh buckets
-- with huge configs, long idle times, deep debts.
--
-- Not a script of its own: the Redis backend joins this file into decide.lua where it
-- says so, after decide.lua's common path (which returns first whenever plain doubles
-- are exact), so a call pays for these definitions only when it needs them. It uses
-- LIMIT (2^53) and fmod (math.fmod) as decide.lua defines them.

local B = 16777216                   -- 2^24: limb base of the bignums
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
  -- 2^53 itself is when it prints back unchanged.
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
