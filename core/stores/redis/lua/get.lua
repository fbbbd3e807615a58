-- Read a record with the server's clock. A record past its expiry is absent; nothing recorded
-- (a lazy first delivery) costs one GET.
-- KEYS[1] record. Reply: nil when absent, else {now, pttl, record} (layout.py reads it).

local v = redis.call('GET', KEYS[1])
if not v then return false end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {now, redis.call('PTTL', KEYS[1]), v}
