-- complete.lua for a handler that sent something (the hand-off): the record becomes status
-- 'p' (completed, sends pending) holding the sends, their dispatch token (the owner) and the
-- recorder's dispatch lease, and is added to the sends index, in the same atomic step.
-- KEYS[1] record; ARGV owner, keep_ms, has_result ("1"/"0"), result, index, sends JSON,
-- member (the key without prefix), dispatch_lease_ms.
-- Reply: 1 done, 0 not the owner's.
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end

local h = redis.call('HMGET', KEYS[1], 'st', 'ow', 'lu')
if h[1] ~= 'i' or h[2] ~= ARGV[1] then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[3] == '1' then
  redis.call('HDEL', KEYS[1], 'ow', 'wk')
  redis.call('HSET', KEYS[1], 'st', 'p', 'sd', ARGV[6], 'sk', ARGV[1], 'sa', ms(now),
             'sl', ms(now + tonumber(ARGV[8])), 'rs', ARGV[4])
else
  redis.call('HDEL', KEYS[1], 'ow', 'rs', 'wk')
  redis.call('HSET', KEYS[1], 'st', 'p', 'sd', ARGV[6], 'sk', ARGV[1], 'sa', ms(now),
             'sl', ms(now + tonumber(ARGV[8])))
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', ARGV[5], now, ARGV[7])
return 1
