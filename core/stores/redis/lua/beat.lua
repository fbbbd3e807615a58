-- Write a worker's liveness record by the server's clock.
-- KEYS[1] liveness record; ARGV ttl_ms, retention_ms. Reply: 1.
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local alive_until = now + tonumber(ARGV[1])
redis.call('HSET', KEYS[1], 'seen', ms(now), 'until', ms(alive_until))
redis.call('PEXPIREAT', KEYS[1], ms(alive_until + tonumber(ARGV[2])))
return 1
