-- Turn the owner's claim into a mark (fenced: the live record must be a claim of ARGV[1]; like
-- the memory store, a claim whose lease ran out but was not taken over is still owned). The
-- record's expiry moves to keep_ms from now by the server's clock: no TIME needed.
-- KEYS[1] record; ARGV owner, keep_ms, has_result ("1"/"0"), result.
-- Reply: 1 done, 0 not the owner's.
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end

local h = redis.call('HMGET', KEYS[1], 'st', 'ow', 'lu')
if h[1] ~= 'i' or h[2] ~= ARGV[1] then return 0 end

if ARGV[3] == '1' then
  redis.call('HDEL', KEYS[1], 'ow', 'wk')
  redis.call('HSET', KEYS[1], 'st', 'c', 'rs', ARGV[4])
else
  redis.call('HDEL', KEYS[1], 'ow', 'rs', 'wk')
  redis.call('HSET', KEYS[1], 'st', 'c')
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
