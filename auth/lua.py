"""The Lua scripts behind RedisLimiter: each runs atomically inside Redis.

Time is Redis's own TIME, so replicas with skewed clocks still share one window.
Keys of one API key share a hash tag ({key_id}) so they live in one cluster slot.

KEYS (every script): 1 log (zset lease -> admitted ms), 2 amounts (hash lease -> tokens),
3 total tokens in the window (string), 4 in-flight leases (zset lease -> deadline ms),
5 budget (hash: window, used), 6 usage (hash "<counter>:<model>" -> n), 7 budget holds
(zset lease -> deadline ms), 8 what each hold took (hash lease -> "<window>:<tokens>");
RELEASE adds 9, a marker that the lease is settled. ACQUIRE and RELEASE are idempotent per
lease, so a call retried after a lost reply changes nothing twice; RENEW only moves
deadlines of leases that still exist.

A budget hold whose deadline passed (its replica died, or could not settle for a whole
TTL) is given back to its window's budget by the next script that reads the budget; a
settlement arriving after that charges the tokens used in full instead of the difference.

The shipped Redis lets the gateway's user run only the commands it calls (docker-compose.yml,
deploy/k8s/redis.yaml): a command new to a script needs its `+command` there too.
"""

_COMMON = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function expire_log(cutoff)
  local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff)
  if #old == 0 then return end
  local freed = 0
  for i = 1, #old, 500 do
    local chunk = {unpack(old, i, math.min(i + 499, #old))}
    local amounts = redis.call('HMGET', KEYS[2], unpack(chunk))
    for j = 1, #chunk do freed = freed + (tonumber(amounts[j]) or 0) end
    redis.call('HDEL', KEYS[2], unpack(chunk))
    redis.call('ZREM', KEYS[1], unpack(chunk))
  end
  redis.call('DECRBY', KEYS[3], freed)
end

local function expire_holds(now)
  local dead = redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', now)
  if #dead == 0 then return end
  local current = redis.call('HGET', KEYS[5], 'window')
  local refund = 0
  for i = 1, #dead, 500 do
    local chunk = {unpack(dead, i, math.min(i + 499, #dead))}
    local held = redis.call('HMGET', KEYS[8], unpack(chunk))
    for j = 1, #chunk do
      local win, tokens = string.match(held[j] or '', '^(-?%d+):(-?%d+)$')
      if win ~= nil and win == current then refund = refund + tonumber(tokens) end
    end
    redis.call('HDEL', KEYS[8], unpack(chunk))
    redis.call('ZREM', KEYS[7], unpack(chunk))
  end
  if refund ~= 0 then redis.call('HINCRBY', KEYS[5], 'used', -refund) end
end
"""

# ARGV: lease, reserve, rpm, tpm, parallel, budget, budget period ms, lease ttl ms, window ms
# (0 = no such limit), dry run (1: decide, take nothing). Returns {reason or "", retry ms,
# requests, tokens, reset ms, budget window, budget used, now ms}.
ACQUIRE = _COMMON + """
local lease, reserve = ARGV[1], tonumber(ARGV[2])
local rpm, tpm, par = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local budget, period = tonumber(ARGV[6]), tonumber(ARGV[7])
local ttl, window = tonumber(ARGV[8]), tonumber(ARGV[9])
local dry = ARGV[10] == '1'
local now = now_ms()
local windowed = rpm > 0 or tpm > 0

local again = redis.call('ZSCORE', KEYS[1], lease) or redis.call('ZSCORE', KEYS[4], lease)
  or redis.call('ZSCORE', KEYS[7], lease)
local count, used = 0, 0
if windowed then
  expire_log(now - window)
  count = redis.call('ZCARD', KEYS[1])
  used = tonumber(redis.call('GET', KEYS[3]) or '0')
end
local running = 0
if par > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  running = redis.call('ZCARD', KEYS[4])
end
local bwin, spent = 0, 0
if budget > 0 then
  if period > 0 then bwin = math.floor(now / period) end
  expire_holds(now)
  local stored = redis.call('HMGET', KEYS[5], 'window', 'used')
  if tonumber(stored[1]) == bwin then spent = tonumber(stored[2]) or 0 end
end

local function oldest()
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if #first == 0 then return now end
  return tonumber(first[2])
end

local function tokens_free_in()
  local entries = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
  local freed = 0
  for i = 1, #entries, 2 do
    freed = freed + (tonumber(redis.call('HGET', KEYS[2], entries[i])) or 0)
    if used - freed + reserve <= tpm then return tonumber(entries[i + 1]) + window - now end
  end
  return window
end

local reason, retry = '', 0
if again then
  reason = ''
elseif tpm > 0 and reserve > tpm then
  reason, retry = 'too_large', window
elseif rpm > 0 and count >= rpm then
  reason, retry = 'requests', oldest() + window - now
elseif tpm > 0 and used + reserve > tpm then
  reason, retry = 'tokens', tokens_free_in()
elseif par > 0 and running >= par then
  reason, retry = 'parallel', 1000
elseif budget > 0 and spent + reserve > budget then
  reason = 'budget'
  if period > 0 then retry = (bwin + 1) * period - now else retry = -1 end
end

if reason == '' and not again and not dry then
  if windowed then
    redis.call('ZADD', KEYS[1], now, lease)
    redis.call('HSET', KEYS[2], lease, reserve)
    redis.call('INCRBY', KEYS[3], reserve)
    for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], window + 1000) end
    count, used = count + 1, used + reserve
  end
  if par > 0 then
    redis.call('ZADD', KEYS[4], now + ttl, lease)
    redis.call('PEXPIRE', KEYS[4], ttl + 1000)
  end
  if budget > 0 then
    spent = spent + reserve
    redis.call('HSET', KEYS[5], 'window', bwin, 'used', spent)
    redis.call('ZADD', KEYS[7], now + ttl, lease)
    redis.call('HSET', KEYS[8], lease, string.format('%d', bwin) .. ':' .. ARGV[2])
    if period > 0 then
      for _, i in ipairs({5, 7, 8}) do redis.call('PEXPIRE', KEYS[i], 2 * period) end
    end
  end
end
local reset = 0
if count > 0 then reset = oldest() + window - now end
return {reason, retry, count, used, reset, bwin, spent, now}
"""

# ARGV: lease, reserved, actual tokens, budget window, budget on (0/1), model,
# prompt tokens, completion tokens, counted (0/1), marker ttl ms.
RELEASE = """
local lease, delta = ARGV[1], tonumber(ARGV[3]) - tonumber(ARGV[2])
if not redis.call('SET', KEYS[9], 1, 'NX', 'PX', tonumber(ARGV[10])) then return 0 end
redis.call('ZREM', KEYS[4], lease)
if delta ~= 0 and redis.call('HEXISTS', KEYS[2], lease) == 1 then
  redis.call('HINCRBY', KEYS[2], lease, delta)
  redis.call('INCRBY', KEYS[3], delta)
end
if ARGV[5] == '1' then
  local held = redis.call('HDEL', KEYS[8], lease) == 1
  redis.call('ZREM', KEYS[7], lease)
  local charge = delta
  if not held then charge = tonumber(ARGV[3]) end  -- the hold expired and was given back
  if charge ~= 0 and redis.call('HGET', KEYS[5], 'window') == ARGV[4] then
    redis.call('HINCRBY', KEYS[5], 'used', charge)
  end
end
local model = ARGV[6]
redis.call('HINCRBY', KEYS[6], 'requests:' .. model, tonumber(ARGV[9]))
redis.call('HINCRBY', KEYS[6], 'prompt_tokens:' .. model, tonumber(ARGV[7]))
redis.call('HINCRBY', KEYS[6], 'completion_tokens:' .. model, tonumber(ARGV[8]))
return 1
"""

# ARGV: lease, lease ttl ms. Returns 1 if the lease (slot or hold) still existed.
RENEW = _COMMON + """
local lease, ttl = ARGV[1], tonumber(ARGV[2])
local deadline = now_ms() + ttl
local found = 0
if redis.call('ZSCORE', KEYS[4], lease) then
  redis.call('ZADD', KEYS[4], 'XX', deadline, lease)
  redis.call('PEXPIRE', KEYS[4], ttl + 1000)
  found = 1
end
if redis.call('ZSCORE', KEYS[7], lease) then
  redis.call('ZADD', KEYS[7], 'XX', deadline, lease)
  found = 1
end
return found
"""

# The budget of the current window, expired holds given back first. Returns {window, used}.
BUDGET = _COMMON + """
expire_holds(now_ms())
return redis.call('HMGET', KEYS[5], 'window', 'used')
"""
