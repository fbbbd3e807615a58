-- complete.lua for a handler that sent something (the hand-off): the record becomes kind 'p'
-- (completed, sends pending) holding the sends, their dispatch token (the owner) and the
-- recorder's dispatch lease, and is added to the sends index, in the same atomic step.
-- KEYS[1] record; ARGV owner, keep_ms, keep_ms in hex, index, sends JSON, member (the key
-- without prefix), dispatch_lease_ms[, result]. Reply: 1 done, 0 not the owner's.
if redis.replicate_commands then redis.replicate_commands() end

local v = redis.call('GET', KEYS[1])
local o = ARGV[1]
local n = #o
if not v or string.byte(v) ~= 105 or string.byte(v, n + 2) ~= 124
    or string.find(v, o, 2, true) ~= 2 then return 0 end
local keep = tonumber(ARGV[2])
local created = keep + tonumber(string.sub(v, n + 3, n + 13), 16) - redis.call('PTTL', KEYS[1])
-- p<created>|<fp>|<token>|<recorded>|<dispatch>|<n>|<sends>[|<result>]
local record = 'p' .. string.format('%x', created) ..
               string.sub(v, n + 26, string.find(v, '|', n + 27, true) - 1) .. '|' .. o ..
               '|' .. ARGV[3] .. '|' .. string.format('%x', math.max(0, keep - ARGV[7])) ..
               '|' .. string.format('%x', #ARGV[5]) .. '|' .. ARGV[5]
if ARGV[8] then record = record .. '|' .. ARGV[8] end
redis.call('SET', KEYS[1], record, 'PX', keep)
local t = redis.call('TIME')
redis.call('ZADD', ARGV[4], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[6])
return 1
