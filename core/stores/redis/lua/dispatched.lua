-- Record a record's pending sends as published (fenced by their dispatch token).
-- KEYS[1] record; ARGV token, index, member. Reply: 1 cleared, 0 not this token's.
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end

local h = redis.call('HMGET', KEYS[1], 'st', 'sk')
if h[1] ~= 'p' or h[2] ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'sd', 'sk', 'sa', 'sl')
redis.call('HSET', KEYS[1], 'st', 'c')
redis.call('ZREM', ARGV[2], ARGV[3])
return 1
