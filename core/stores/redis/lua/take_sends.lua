-- Take the dispatch lease of a record's pending sends. The lease's own holder may take it
-- again: to renew it, or with lease 0 to let it go.
-- KEYS[1] record; ARGV token, lease_ms, min_age_ms, index, member.
-- Reply: 0 nothing to take (none pending, or too young), {ms} another dispatcher's lease has
-- ms left, or the sends JSON.
if redis.replicate_commands then redis.replicate_commands() end

local v = redis.call('GET', KEYS[1])
local kind = v and string.sub(v, 1, 1)
if kind ~= 'p' and kind ~= 'q' then redis.call('ZREM', ARGV[4], ARGV[5]) return 0 end
-- p<created>|<fp>|<token>|<recorded>|<dispatch>|<n>|<sends>[|<result>]
local a = string.find(v, '|', 2, true)
local b = string.find(v, '|', a + 1, true)
local c = string.find(v, '|', b + 1, true)
local d = string.find(v, '|', c + 1, true)
local e = string.find(v, '|', d + 1, true)
local f = string.find(v, '|', e + 1, true)
local x = math.max(1, redis.call('PTTL', KEYS[1]))  -- times are offsets before the expiry
-- recorded less than min_age ago: x - recorded > -min_age (no TIME needed)
if x - tonumber(string.sub(v, c + 1, d - 1), 16) + tonumber(ARGV[3]) > 0 then return 0 end
local left = x - tonumber(string.sub(v, d + 1, e - 1), 16)  -- the dispatcher's lease, ms left
if left > 0 and string.sub(v, b + 1, c - 1) ~= ARGV[1] then return {left} end
redis.call('SET', KEYS[1], string.sub(v, 1, b) .. ARGV[1] .. '|' .. string.sub(v, c + 1, d) ..
           string.format('%x', math.max(0, x - tonumber(ARGV[2]))) .. string.sub(v, e), 'PX', x)
return string.sub(v, f + 1, f + tonumber(string.sub(v, e + 1, f - 1), 16))
