-- Extend the owner's lease to lease_ms from now (fenced, as in complete.lua). The expiry moves
-- by as much as the lease end moves forward, so a renewed claim still outlives its lease by
-- keep_for; the record's offsets move with it. PTTL, no TIME: with x = PTTL the lease ends
-- x - lease_offset from now.
-- KEYS[1] record; ARGV owner, lease_ms. Reply: 1 renewed, 0 not the owner's.
if redis.replicate_commands then redis.replicate_commands() end

local v = redis.call('GET', KEYS[1])
local o = ARGV[1]
local n = #o
if not v or string.byte(v) ~= 105 or string.byte(v, n + 2) ~= 124
    or string.find(v, o, 2, true) ~= 2 then return 0 end
local x = redis.call('PTTL', KEYS[1])
local lease = tonumber(ARGV[2])
local remaining = x + math.max(0, lease - x + tonumber(string.sub(v, n + 15, n + 25), 16))
local created = tonumber(string.sub(v, n + 3, n + 13), 16) + remaining - x
redis.call('SET', KEYS[1], 'i' .. o .. '|' .. string.format('%011x', created) .. '|' ..
           string.format('%011x', remaining - lease) .. string.sub(v, n + 26), 'PX', remaining)
return 1
