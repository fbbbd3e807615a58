-- Record a record's pending sends as published (fenced by their dispatch token): kind 'p'
-- becomes 'c' and 'q' becomes 'm', without the sends block, and it leaves the sends index.
-- KEYS[1] record; ARGV token, index, member. Reply: 1 cleared, 0 not this token's.
if redis.replicate_commands then redis.replicate_commands() end

local v = redis.call('GET', KEYS[1])
local kind = v and string.sub(v, 1, 1)
if kind ~= 'p' and kind ~= 'q' then return 0 end
local a = string.find(v, '|', 2, true)
local b = string.find(v, '|', a + 1, true)
local c = string.find(v, '|', b + 1, true)
if string.sub(v, b + 1, c - 1) ~= ARGV[1] then return 0 end
local d = string.find(v, '|', c + 1, true)
local e = string.find(v, '|', d + 1, true)
local f = string.find(v, '|', e + 1, true)
local rest = string.sub(v, f + 1 + tonumber(string.sub(v, e + 1, f - 1), 16))  -- '' or '|result'
redis.call('SET', KEYS[1], (kind == 'p' and 'c' or 'm') .. string.sub(v, 2, b - 1) .. rest,
           'PX', math.max(1, redis.call('PTTL', KEYS[1])))
redis.call('ZREM', ARGV[2], ARGV[3])
return 1
