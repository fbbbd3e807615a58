-- Hand a live claim whose owner is known dead to a new owner (fenced by the old owner token).
-- The fingerprint and the first claim's time are kept.
-- KEYS[1] record; ARGV old owner, new owner, lease_ms, keep_ms, worker.
-- Reply: 1 taken over, 0 the live record is not the old owner's claim (nothing changed).
if redis.replicate_commands then redis.replicate_commands() end

local v = redis.call('GET', KEYS[1])
local o = ARGV[1]
if not v or string.sub(v, 1, #o + 2) ~= 'i' .. o .. '|' then return 0 end
local b = string.find(v, '|', #o + 3, true)
local c = string.find(v, '|', b + 1, true)
local d = string.find(v, '|', c + 1, true)
local ttl = tonumber(ARGV[3]) + tonumber(ARGV[4])
local created = ttl + tonumber(string.sub(v, #o + 3, b - 1)) - redis.call('PTTL', KEYS[1])
redis.call('SET', KEYS[1], 'i' .. ARGV[2] .. '|' .. created .. '|' .. ARGV[4] .. '|' ..
           string.sub(v, c + 1, d - 1) .. '|' .. ARGV[5], 'PX', ttl)
return 1
