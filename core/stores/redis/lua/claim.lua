-- Claim a key: a new claim, or the takeover of a claim whose lease ran out (same payload).
-- KEYS[1] record; ARGV owner, lease_ms, keep_ms, has_fp ("1"/"0"), fp, worker ("" = none).
-- Reply: 1 claimed, 2 taken over, or {now, st, ow, fp, rs, ca, lu, ex, wk} for "exists".
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end

local h = redis.call('HMGET', KEYS[1], 'st', 'ow', 'fp', 'rs', 'ca', 'lu', 'wk')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local outcome = 1
local created = now
if h[1] then
  local expired_claim = h[1] == 'i' and tonumber(h[6]) <= now
  local same_payload = (not h[3]) or ARGV[4] ~= '1' or h[3] == ARGV[5]
  if not (expired_claim and same_payload) then
    local ex = ms(now + redis.call('PTTL', KEYS[1]))
    return {now, h[1], h[2], h[3], h[4], h[5], h[6], ex, h[7]}
  end
  outcome = 2
  created = tonumber(h[5])
  redis.call('DEL', KEYS[1])
end
local lease = tonumber(ARGV[2])
local f = {'st', 'i', 'ow', ARGV[1], 'ca', ms(created), 'lu', ms(now + lease)}
if ARGV[4] == '1' then f[#f + 1] = 'fp'; f[#f + 1] = ARGV[5] end
if ARGV[6] ~= '' then f[#f + 1] = 'wk'; f[#f + 1] = ARGV[6] end
redis.call('HSET', KEYS[1], unpack(f))
redis.call('PEXPIRE', KEYS[1], lease + tonumber(ARGV[3]))
return outcome
