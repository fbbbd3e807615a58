-- A claim that found a record (the client's plain SET … NX PX did not write): the takeover of
-- a claim whose lease ran out (same payload), else the record found. Also a whole claim on its
-- own: a record that expired meanwhile is claimed here.
-- KEYS[1] record; ARGV owner, ttl_ms (lease + keep), keep_ms, fp, worker (as layout.py packs
-- them; an absent fp or worker is empty). Reply: 1 claimed, 2 taken over, or {now, pttl, record}.
if redis.replicate_commands then redis.replicate_commands() end

local v = redis.call('GET', KEYS[1])
local ttl = tonumber(ARGV[2])
if not v then
  redis.call('SET', KEYS[1], 'i' .. ARGV[1] .. '|' .. ttl .. '|' .. ARGV[3] .. '|' .. ARGV[4] ..
             '|' .. ARGV[5], 'PX', ttl)
  return 1
end
local x = redis.call('PTTL', KEYS[1])
if string.sub(v, 1, 1) == 'i' then
  -- i<owner>|<created>|<lease>|<fp>|<worker>: the lease ran out when PTTL <= lease
  local a = string.find(v, '|', 2, true)
  local b = string.find(v, '|', a + 1, true)
  local c = string.find(v, '|', b + 1, true)
  local d = string.find(v, '|', c + 1, true)
  local fp = string.sub(v, c + 1, d - 1)
  if x <= tonumber(string.sub(v, b + 1, c - 1))
      and (fp == '' or ARGV[4] == '' or fp == ARGV[4]) then
    local created = ttl + tonumber(string.sub(v, a + 1, b - 1)) - x  -- the first claim's time
    redis.call('SET', KEYS[1], 'i' .. ARGV[1] .. '|' .. created .. '|' .. ARGV[3] .. '|' ..
               ARGV[4] .. '|' .. ARGV[5], 'PX', ttl)
    return 2
  end
end
local t = redis.call('TIME')
return {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), x, v}
