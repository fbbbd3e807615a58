-- Extend the owner's lease (fenced, as in complete.lua). The expiry moves by as much as the
-- lease end moves forward, so a renewed claim still outlives its lease by keep_for.
-- KEYS[1] record; ARGV owner, lease_ms. Reply: 1 renewed, 0 not the owner's.
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end

local h = redis.call('HMGET', KEYS[1], 'st', 'ow', 'lu')
if h[1] ~= 'i' or h[2] ~= ARGV[1] then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease_until = now + tonumber(ARGV[2])
local expires = now + redis.call('PTTL', KEYS[1]) + math.max(0, lease_until - tonumber(h[3]))
redis.call('HSET', KEYS[1], 'lu', ms(lease_until))
redis.call('PEXPIREAT', KEYS[1], ms(expires))
return 1
