-- complete.lua for a handler that sent something (the hand-off): the record becomes kind 'p'
-- (completed, sends pending) holding the sends, their dispatch token (the owner) and the
-- recorder's dispatch lease, and is added to the sends index, in the same atomic step.
-- KEYS[1] record; ARGV owner, keep_ms, index, sends JSON, member (the key without prefix),
-- dispatch_lease_ms[, result]. Reply: 1 done, 0 not the owner's.
if redis.replicate_commands then redis.replicate_commands() end

local v = redis.call('GET', KEYS[1])
local o = ARGV[1]
if not v or string.sub(v, 1, #o + 2) ~= 'i' .. o .. '|' then return 0 end
local b = string.find(v, '|', #o + 3, true)
local c = string.find(v, '|', b + 1, true)
local d = string.find(v, '|', c + 1, true)
local keep = tonumber(ARGV[2])
local created = keep + string.sub(v, #o + 3, b - 1) - redis.call('PTTL', KEYS[1])
-- p<created>|<fp>|<token>|<recorded>|<dispatch>|<n>|<sends>[|<result>]
local record = 'p' .. created .. '|' .. string.sub(v, c + 1, d - 1) .. '|' .. o .. '|' .. keep ..
               '|' .. (keep - tonumber(ARGV[6])) .. '|' .. #ARGV[4] .. '|' .. ARGV[4]
if ARGV[7] then record = record .. '|' .. ARGV[7] end
redis.call('SET', KEYS[1], record, 'PX', keep)
local t = redis.call('TIME')
redis.call('ZADD', ARGV[3], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[5])
return 1
