-- Delete the owner's claim so a retry can claim again (fenced, as in complete.lua).
-- KEYS[1] record; ARGV owner. Reply: 1 deleted, 0 not the owner's.

local v = redis.call('GET', KEYS[1])
local n = #ARGV[1]
if not v or string.byte(v) ~= 105 or string.byte(v, n + 2) ~= 124
    or string.find(v, ARGV[1], 2, true) ~= 2 then return 0 end
redis.call('DEL', KEYS[1])
return 1
