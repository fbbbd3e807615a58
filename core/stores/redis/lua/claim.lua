-- A claim that found a record (the client's plain SET … NX PX did not write): the takeover of
-- a claim whose lease ran out (same payload), else the record found. Also a whole claim on its
-- own: a record that expired meanwhile is claimed here.
-- KEYS[1] record; ARGV owner, ttl_ms (lease + keep), keep_ms, fp, worker (as layout.py packs
-- them; an absent fp or worker is empty). Reply: 1 claimed, 2 taken over, or {now, pttl, record}.
if redis.replicate_commands then redis.replicate_commands() end

local v = redis.call('GET', KEYS[1])
local ttl = tonumber(ARGV[2])
local tail = '|' .. string.format('%011x', ARGV[3]) .. '|' .. ARGV[4] .. '|' .. ARGV[5]
if not v then
  redis.call('SET', KEYS[1], 'i' .. ARGV[1] .. '|' .. string.format('%011x', ttl) .. tail,
             'PX', ttl)
  return 1
end
local x = redis.call('PTTL', KEYS[1])
if string.byte(v) == 105 then
  -- i<owner>|<created:11>|<lease:11>|<fp>|<worker>: the lease ran out when PTTL <= lease
  local a = string.find(v, '|', 2, true)
  local d = string.find(v, '|', a + 25, true)
  local fp = string.sub(v, a + 25, d - 1)
  if x <= tonumber(string.sub(v, a + 13, a + 23), 16)
      and (fp == '' or ARGV[4] == '' or fp == ARGV[4]) then
    local created = ttl + tonumber(string.sub(v, a + 1, a + 11), 16) - x  -- the first claim's
    redis.call('SET', KEYS[1], 'i' .. ARGV[1] .. '|' .. string.format('%011x', created) .. tail,
               'PX', ttl)
    return 2
  end
end
local t = redis.call('TIME')
return {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), x, v}
