-- A claim that found a record (the client's plain SET … NX PX did not write): the takeover of
-- a claim whose lease ran out (same payload), counted in its crashes field (layout.py), else
-- the record found. Also a whole claim on its own: a record that expired meanwhile is claimed
-- here.
-- KEYS[1] record; ARGV owner, ttl_ms (lease + keep), keep_ms, fp, worker (as layout.py packs
-- them; an absent fp or worker is empty). Reply: 1 claimed, 1 + the key's take-overs so far
-- (>= 2) taken over, or {now, pttl, record}.
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
  -- i<owner>|<created:11>|<lease:11>|<fp>|<worker>[|<crashes>]: the lease ran out when
  -- PTTL <= lease
  local a = string.find(v, '|', 2, true)
  local d = string.find(v, '|', a + 25, true)
  local fp = string.sub(v, a + 25, d - 1)
  if x <= tonumber(string.sub(v, a + 13, a + 23), 16)
      and (fp == '' or ARGV[4] == '' or fp == ARGV[4]) then
    local created = ttl + tonumber(string.sub(v, a + 1, a + 11), 16) - x  -- the first claim's
    local e = string.find(v, '|', d + 1, true)
    local crashes = (e and tonumber(string.sub(v, e + 1), 16) or 0) + 1
    redis.call('SET', KEYS[1], 'i' .. ARGV[1] .. '|' .. string.format('%011x', created) .. tail
               .. '|' .. string.format('%x', crashes), 'PX', ttl)
    return 1 + crashes
  end
end
local t = redis.call('TIME')
return {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), x, v}
