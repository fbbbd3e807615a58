-- The relay's work in one round trip: the members of a sends index recorded at least min_age
-- ago and those of a receipts index due by now (both scored in server ms), each oldest first.
-- KEYS[1] sends index; ARGV receipts index, min_age_ms, limit. Reply: {sends, receipts}.
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit = tonumber(ARGV[3])
return {redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]), 'LIMIT', 0, limit),
        redis.call('ZRANGEBYSCORE', ARGV[1], '-inf', now, 'LIMIT', 0, limit)}
