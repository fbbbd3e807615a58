-- Record a key as handled (lazy mode), unless a live record exists.
-- KEYS[1] record; ARGV keep_ms, has_fp, fp, has_result, result.
-- Reply: 1 written, 0 a live record exists (nothing changed).
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end

if redis.call('HGET', KEYS[1], 'st') then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local f = {'st', 'c', 'ca', ms(now)}
if ARGV[2] == '1' then f[#f + 1] = 'fp'; f[#f + 1] = ARGV[3] end
if ARGV[4] == '1' then f[#f + 1] = 'rs'; f[#f + 1] = ARGV[5] end
redis.call('HSET', KEYS[1], unpack(f))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
