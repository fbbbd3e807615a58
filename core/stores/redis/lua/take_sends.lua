-- Take the dispatch lease of a record's pending sends. The lease's own holder may take it
-- again: to renew it, or with lease 0 to let it go.
-- KEYS[1] record; ARGV token, lease_ms, min_age_ms, index, member.
-- Reply: 0 nothing to take (none pending, or too young), {ms} another dispatcher's lease has
-- ms left, or the sends JSON.
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local h = redis.call('HMGET', KEYS[1], 'st', 'sa', 'sl', 'sd', 'sk')
if h[1] ~= 'p' then redis.call('ZREM', ARGV[4], ARGV[5]) return 0 end
if tonumber(h[2]) > now - tonumber(ARGV[3]) then return 0 end
if h[3] and tonumber(h[3]) > now and h[5] ~= ARGV[1] then return {tonumber(h[3]) - now} end
redis.call('HSET', KEYS[1], 'sk', ARGV[1], 'sl', ms(now + tonumber(ARGV[2])))
return h[4]
