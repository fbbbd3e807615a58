-- mark.lua for a handler that sent something (the hand-off): the mark has status 'p'
-- (completed, sends pending) and holds the sends, their dispatch token and the recorder's
-- dispatch lease, and is added to the sends index, in the same atomic step.
-- KEYS[1] record; ARGV keep_ms, has_fp, fp, has_result, result, index, sends JSON, member
-- (the key without prefix), dispatch token, dispatch_lease_ms.
-- Reply: 1 written, 0 a live record exists (nothing changed).
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end

if redis.call('HGET', KEYS[1], 'st') then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local f = {'st', 'p', 'ca', ms(now), 'sd', ARGV[7], 'sk', ARGV[9], 'sa', ms(now),
           'sl', ms(now + tonumber(ARGV[10]))}
if ARGV[2] == '1' then f[#f + 1] = 'fp'; f[#f + 1] = ARGV[3] end
if ARGV[4] == '1' then f[#f + 1] = 'rs'; f[#f + 1] = ARGV[5] end
redis.call('HSET', KEYS[1], unpack(f))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('ZADD', ARGV[6], now, ARGV[8])
return 1
