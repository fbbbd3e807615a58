-- Read a worker's liveness record with the server's clock.
-- KEYS[1] liveness record. Reply: nil when absent, else {now, seen, until}.
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local h = redis.call('HMGET', KEYS[1], 'seen', 'until')
if not h[1] then return false end
return {now, h[1], h[2]}
