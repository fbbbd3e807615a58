-- Hand a live claim whose owner is known dead to a new owner (fenced by the old owner token),
-- counting the take-over in the claim's crashes field (layout.py). The fingerprint and the
-- first claim's time are kept.
-- KEYS[1] record; ARGV old owner, new owner, lease_ms, keep_ms, worker.
-- Reply: the key's take-overs so far (this one included, >= 1), or 0 when the live record is
-- not the old owner's claim (nothing changed).
if redis.replicate_commands then redis.replicate_commands() end

local v = redis.call('GET', KEYS[1])
local o = ARGV[1]
local n = #o
if not v or string.byte(v) ~= 105 or string.byte(v, n + 2) ~= 124
    or string.find(v, o, 2, true) ~= 2 then return 0 end
local ttl = tonumber(ARGV[3]) + tonumber(ARGV[4])
local created = ttl + tonumber(string.sub(v, n + 3, n + 13), 16) - redis.call('PTTL', KEYS[1])
-- i<owner>|<created:11>|<lease:11>|<fp>|<worker>[|<crashes>]
local d = string.find(v, '|', n + 27, true)
local e = string.find(v, '|', d + 1, true)
local crashes = (e and tonumber(string.sub(v, e + 1), 16) or 0) + 1
redis.call('SET', KEYS[1], 'i' .. ARGV[2] .. '|' .. string.format('%011x', created) .. '|' ..
           string.format('%011x', ARGV[4]) .. string.sub(v, n + 26, d) .. ARGV[5] .. '|' ..
           string.format('%x', crashes), 'PX', ttl)
return crashes
