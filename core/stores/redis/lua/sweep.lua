-- Purge's sweep of an index (Redis deletes the expired records themselves, not their index
-- entries): a batch of its members, by rank, whose record is gone or of no kind the index
-- lists leaves it, so the counts and the relay's listing see live records only.
-- KEYS[1] index; ARGV the records' name prefix, the kinds it lists ('pq' or 'ab'), first rank,
-- count. Reply: {members looked at, members removed}.
if redis.replicate_commands then redis.replicate_commands() end
local members = redis.call('ZRANGE', KEYS[1], tonumber(ARGV[3]),
                           tonumber(ARGV[3]) + tonumber(ARGV[4]) - 1)
local removed = 0
for _, member in ipairs(members) do
  local name = ARGV[1] .. member
  local kind = redis.call('TYPE', name).ok == 'string' and
               string.sub(redis.call('GET', name), 1, 1) or ''
  if kind == '' or not string.find(ARGV[2], kind, 1, true) then
    redis.call('ZREM', KEYS[1], member)
    removed = removed + 1
  end
end
return {#members, removed}
