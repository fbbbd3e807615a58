-- An operator's release: the record and its pending sends or awaited receipts, whatever is
-- recorded.
-- KEYS[1] record; ARGV sends index, member, receipts index. Reply: 1.

redis.call('DEL', KEYS[1])
redis.call('ZREM', ARGV[1], ARGV[2])
redis.call('ZREM', ARGV[3], ARGV[2])
return 1
