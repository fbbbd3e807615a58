-- Turn the owner's claim into a completed record (fenced: the live record must be a claim of
-- ARGV[1]; like the memory store, a claim whose lease ran out but was not taken over is still
-- owned). It keeps the claim's fingerprint and first time, moved to the new expiry: PTTL, no
-- TIME. The hot path of every eager message: three commands, no search for the claim's
-- numbers (fixed width), hex numbers (strtoul and %x, not strtod and %.14g).
-- KEYS[1] record; ARGV owner, keep_ms, keep_ms in hex[, result].
-- Reply: 1 done, 0 not the owner's.
if redis.replicate_commands then redis.replicate_commands() end

local v = redis.call('GET', KEYS[1])
local o = ARGV[1]
local n = #o
-- i<owner>|<created:11>|<lease:11>|<fp>|<worker>
if not v or string.byte(v) ~= 105 or string.byte(v, n + 2) ~= 124
    or string.find(v, o, 2, true) ~= 2 then return 0 end
local created = tonumber(ARGV[3], 16) + tonumber(string.sub(v, n + 3, n + 13), 16)
                - redis.call('PTTL', KEYS[1])
local record = 'c' .. string.format('%x', created) ..
               string.sub(v, n + 26, string.find(v, '|', n + 27, true) - 1)
if ARGV[4] then record = record .. '|' .. ARGV[4] end
redis.call('SET', KEYS[1], record, 'PX', ARGV[2])
return 1
