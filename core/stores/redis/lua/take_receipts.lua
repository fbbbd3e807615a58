-- Take the relay's lease of a record's awaited receipts once they are due (server clock, from
-- PTTL alone: due when PTTL <= due). The lease's own holder may take it again. A record gone,
-- not awaiting, or whose entries were given up on leaves the receipts index.
-- KEYS[1] record; ARGV token, lease_ms, receipts index, member.
-- Reply: 0 nothing to take (none awaited, or not due yet), {ms} another relay's lease has ms
-- left, or {entries, ms past due}.
if redis.replicate_commands then redis.replicate_commands() end

local v = redis.call('GET', KEYS[1])
local kind = v and string.sub(v, 1, 1)
if kind ~= 'a' and kind ~= 'b' then redis.call('ZREM', ARGV[3], ARGV[4]) return 0 end
-- a<created>|<fp>|<token>|<due>|<dispatch>|<n>|<entries>[|<result>]
local a = string.find(v, '|', 2, true)
local b = string.find(v, '|', a + 1, true)
local c = string.find(v, '|', b + 1, true)
local d = string.find(v, '|', c + 1, true)
if d == c + 1 then redis.call('ZREM', ARGV[3], ARGV[4]) return 0 end  -- given up on
local e = string.find(v, '|', d + 1, true)
local f = string.find(v, '|', e + 1, true)
local x = math.max(1, redis.call('PTTL', KEYS[1]))  -- times are offsets before the expiry
local late = tonumber(string.sub(v, c + 1, d - 1), 16) - x
if late < 0 then return 0 end  -- not due yet
local left = x - tonumber(string.sub(v, d + 1, e - 1), 16)  -- the relay's lease, ms left
if left > 0 and string.sub(v, b + 1, c - 1) ~= ARGV[1] then return {left} end
redis.call('SET', KEYS[1], string.sub(v, 1, b) .. ARGV[1] .. '|' .. string.sub(v, c + 1, d) ..
           string.format('%x', math.max(0, x - tonumber(ARGV[2]))) .. string.sub(v, e), 'PX', x)
return {string.sub(v, f + 1, f + tonumber(string.sub(v, e + 1, f - 1), 16)), late}
