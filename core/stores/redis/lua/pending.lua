-- The members of a sends index recorded at least min_age ago, oldest first.
-- KEYS[1] the index; ARGV min_age_ms, limit. Reply: the members.
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]),
                  'LIMIT', 0, tonumber(ARGV[2]))
