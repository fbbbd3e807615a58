-- Turn the owner's claim into a quarantined record (fenced, as in complete.lua): kind 'x' with
-- the claim's fingerprint, first time (moved to the new expiry: PTTL, no TIME) and crashes.
-- KEYS[1] record; ARGV owner, keep_ms. Reply: 1 done, 0 not the owner's.
if redis.replicate_commands then redis.replicate_commands() end

local v = redis.call('GET', KEYS[1])
local o = ARGV[1]
local n = #o
-- i<owner>|<created:11>|<lease:11>|<fp>|<worker>[|<crashes>]
if not v or string.byte(v) ~= 105 or string.byte(v, n + 2) ~= 124
    or string.find(v, o, 2, true) ~= 2 then return 0 end
local created = tonumber(ARGV[2]) + tonumber(string.sub(v, n + 3, n + 13), 16)
                - redis.call('PTTL', KEYS[1])
local d = string.find(v, '|', n + 27, true)
local e = string.find(v, '|', d + 1, true)
local crashes = e and string.sub(v, e + 1) or '0'
redis.call('SET', KEYS[1], 'x' .. string.format('%x', created) .. string.sub(v, n + 26, d) ..
           crashes, 'PX', ARGV[2])
return 1
