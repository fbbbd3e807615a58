-- Read a record. A record past its expiry is absent; nothing recorded (a lazy first delivery)
-- costs one HMGET.
-- KEYS[1] record. Reply: nil when absent, else {now, st, ow, fp, rs, ca, lu, ex, wk, sd}.
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end

local h = redis.call('HMGET', KEYS[1], 'st', 'ow', 'fp', 'rs', 'ca', 'lu', 'wk', 'sd')
if not h[1] then return false end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ex = ms(now + redis.call('PTTL', KEYS[1]))
return {now, h[1], h[2], h[3], h[4], h[5], h[6], ex, h[7], h[8]}
