-- Write what a record awaits (taskonce.receipts), fenced by the token: a record's published
-- sends (kind 'p'/'q', its dispatch token: StoreSends.dispatched with awaiting) or its awaited
-- receipts (kind 'a'/'b', the relay's token: settle_receipts). The record becomes 'a' (eager)
-- or 'b' (lazy) holding the entries, due due_ms from now, the lease let go (token empty, its
-- end now), kept at least hold_ms; without entries it becomes 'c'/'m' (every receipt came).
-- It leaves the sends index and joins the receipts index (score: the due time, server ms), or
-- leaves that too when none is awaited; all in one atomic step. The record's times are offsets
-- before its expiry, so a later expiry moves each of them by as much.
-- KEYS[1] record; ARGV kinds it may be ('pq' or 'ab'), token, sends index, receipts index,
-- member (the key without prefix)[, entries, due_ms ('' when none is awaited), hold_ms].
-- Reply: 1 written, 0 not a record of those kinds or not this token's (nothing changed).
if redis.replicate_commands then redis.replicate_commands() end

local v = redis.call('GET', KEYS[1])
local kind = v and string.sub(v, 1, 1)
if not kind or kind == '' or not string.find(ARGV[1], kind, 1, true) then return 0 end
-- <kind><created>|<fp>|<token>|<recorded or due>|<dispatch>|<n>|<block>[|<result>]
local a = string.find(v, '|', 2, true)
local b = string.find(v, '|', a + 1, true)
local c = string.find(v, '|', b + 1, true)
if string.sub(v, b + 1, c - 1) ~= ARGV[2] then return 0 end
local d = string.find(v, '|', c + 1, true)
local e = string.find(v, '|', d + 1, true)
local f = string.find(v, '|', e + 1, true)
local rest = string.sub(v, f + 1 + tonumber(string.sub(v, e + 1, f - 1), 16))  -- '' or '|result'
local eager = kind == 'p' or kind == 'a'
local x = math.max(1, redis.call('PTTL', KEYS[1]))
redis.call('ZREM', ARGV[3], ARGV[5])
if not ARGV[6] then
  redis.call('SET', KEYS[1], (eager and 'c' or 'm') .. string.sub(v, 2, b - 1) .. rest, 'PX', x)
  redis.call('ZREM', ARGV[4], ARGV[5])
  return 1
end
local ttl = math.max(x, tonumber(ARGV[8]))
local created = tonumber(string.sub(v, 2, a - 1), 16) + ttl - x
local due = ''
-- a due time not before the new expiry is never reached (the record is gone first): 0
if ARGV[7] ~= '' then due = string.format('%x', math.max(0, ttl - tonumber(ARGV[7]))) end
redis.call('SET', KEYS[1], (eager and 'a' or 'b') .. string.format('%x', created) ..
           string.sub(v, a, b) .. '|' .. due .. '|' .. string.format('%x', ttl) .. '|' ..
           string.format('%x', #ARGV[6]) .. '|' .. ARGV[6] .. rest, 'PX', ttl)
if due == '' then
  redis.call('ZREM', ARGV[4], ARGV[5])
else
  local t = redis.call('TIME')
  redis.call('ZADD', ARGV[4], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) +
             tonumber(ARGV[7]), ARGV[5])
end
return 1
