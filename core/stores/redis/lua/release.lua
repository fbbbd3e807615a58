-- Delete the owner's claim so a retry can claim again (fenced, as in complete.lua).
-- KEYS[1] record; ARGV owner. Reply: 1 deleted, 0 not the owner's.
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end

local h = redis.call('HMGET', KEYS[1], 'st', 'ow', 'lu')
if h[1] ~= 'i' or h[2] ~= ARGV[1] then return 0 end

redis.call('DEL', KEYS[1])
return 1
