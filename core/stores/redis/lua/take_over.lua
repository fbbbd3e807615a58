-- Hand a live claim whose owner is known dead to a new owner (fenced by the old owner token).
-- KEYS[1] record; ARGV old owner, new owner, lease_ms, keep_ms, worker.
-- Reply: 1 taken over, 0 the live record is not the old owner's claim (nothing changed).
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end

local h = redis.call('HMGET', KEYS[1], 'st', 'ow')
if h[1] ~= 'i' or h[2] ~= ARGV[1] then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 'ow', ARGV[2], 'wk', ARGV[5], 'lu', ms(now + tonumber(ARGV[3])))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) + tonumber(ARGV[4]))
return 1
