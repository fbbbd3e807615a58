-- Extend the owner's lease to lease_ms from now (fenced, as in complete.lua). The expiry moves
-- by as much as the lease end moves forward, so a renewed claim still outlives its lease by
-- keep_for; the record's offsets move with it. PTTL, no TIME: with x = PTTL the lease ends at
-- x - lease_offset from now.
-- KEYS[1] record; ARGV owner, lease_ms. Reply: 1 renewed, 0 not the owner's.
if redis.replicate_commands then redis.replicate_commands() end

local v = redis.call('GET', KEYS[1])
local o = ARGV[1]
if not v or string.sub(v, 1, #o + 2) ~= 'i' .. o .. '|' then return 0 end
local b = string.find(v, '|', #o + 3, true)
local c = string.find(v, '|', b + 1, true)
local x = redis.call('PTTL', KEYS[1])
local lease = tonumber(ARGV[2])
local remaining = x + math.max(0, lease - x + tonumber(string.sub(v, b + 1, c - 1)))
local created = tonumber(string.sub(v, #o + 3, b - 1)) + remaining - x
redis.call('SET', KEYS[1], 'i' .. o .. '|' .. created .. '|' .. (remaining - lease) ..
           string.sub(v, c), 'PX', remaining)
return 1
