-- An operator's release: the record and its pending sends, whatever is recorded.
-- KEYS[1] record; ARGV index, member. Reply: 1.

redis.call('DEL', KEYS[1])
redis.call('ZREM', ARGV[1], ARGV[2])
return 1
