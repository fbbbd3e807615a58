-- Turn the owner's claim into a completed record (fenced: the live record must be a claim of
-- ARGV[1]; like the memory store, a claim whose lease ran out but was not taken over is still
-- owned). It keeps the claim's fingerprint and first time, moved to the new expiry: PTTL, no
-- TIME.
-- KEYS[1] record; ARGV owner, keep_ms[, result]. Reply: 1 done, 0 not the owner's.
if redis.replicate_commands then redis.replicate_commands() end

local v = redis.call('GET', KEYS[1])
local o = ARGV[1]
if not v or string.sub(v, 1, #o + 2) ~= 'i' .. o .. '|' then return 0 end
-- i<owner>|<created>|<lease>|<fp>|<worker>
local b = string.find(v, '|', #o + 3, true)
local c = string.find(v, '|', b + 1, true)
local d = string.find(v, '|', c + 1, true)
local created = ARGV[2] + string.sub(v, #o + 3, b - 1) - redis.call('PTTL', KEYS[1])
local record = 'c' .. created .. '|' .. string.sub(v, c + 1, d - 1)
if ARGV[3] then record = record .. '|' .. ARGV[3] end
redis.call('SET', KEYS[1], record, 'PX', ARGV[2])
return 1
