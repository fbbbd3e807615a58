-- A lazy mark with deferred sends (the hand-off): the record the client packed (kind 'q':
-- marked, sends pending, with their dispatch token and the recorder's dispatch lease) unless a
-- live record exists, and its entry in the sends index, in the same atomic step. (A mark
-- without sends is the client's plain SET … NX PX.)
-- KEYS[1] record; ARGV record, keep_ms, index, member (the key without prefix).
-- Reply: 1 written, 0 a live record exists (nothing changed).
if redis.replicate_commands then redis.replicate_commands() end

if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
local t = redis.call('TIME')
redis.call('ZADD', ARGV[3], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[4])
return 1
