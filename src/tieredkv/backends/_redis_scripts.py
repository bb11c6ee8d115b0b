"""The Lua steps of a Redis tier: every change to a conversation's manifest is one of these,
run by the server atomically (the manifest's fields: :mod:`.redis_manifest`).

Each returns ``{code, now_ms, ...}``: the server's clock in milliseconds comes back with
every reply, so a client can bound when the server may still apply a request it stopped
waiting for (see ``COMMIT``'s deadline). Fields another client wrote as garbage read as 0
(``num``) rather than failing the script; the client then checks the manifest it reads.
"""

from __future__ import annotations

__all__ = ["ACQUIRE", "COMMIT", "DROP", "ENSURE", "RECLAIM", "RELEASE", "SETTLE", "TAKE"]

_COMMON = """
local function num(x) return tonumber(x) or 0 end
local function fmt(x) return string.format('%d', x) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function new_token(fence) return fmt(math.max(num(fence) + 1, now_us)) end
"""

TAKE = (
    _COMMON
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, now} end
local f = redis.call('HMGET', KEYS[1], 'fence', 'owner', 'le', 'nb', 'n')
if num(f[5]) == 0 then return {-2, now, redis.call('HGETALL', KEYS[1])} end
local token = f[1]
if not token or token ~= ARGV[3] then
  token = new_token(f[1])
  redis.call('HDEL', KEYS[1], 'dmg')
  local nb = num(f[4])
  if f[2] and f[2] ~= ARGV[1] and num(f[3]) > now then
    nb = math.max(nb, num(f[3]))
    redis.call('HSET', KEYS[1], 'nbo', f[2])
  end
  redis.call('HSET', KEYS[1], 'fence', token, 'nb', fmt(nb))
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'le', fmt(now + tonumber(ARGV[2])))
return {0, now, redis.call('HGETALL', KEYS[1]), token}
"""
)
"""KEYS: manifest; ARGV: owner, lease ms, the token this replica holds ('' for none).
Becomes the writer of a conversation with committed segments and returns its manifest:
{0, now, fields, token}; {-1, now}: no manifest; {-2, now, fields}: no segments (nothing
taken). Taking over a live lease of another replica sets ``nb`` to that lease's end, and
``nbo`` to that replica (see ``RECLAIM``)."""

ACQUIRE = (
    _COMMON
    + """
local f = redis.call('HMGET', KEYS[1], 'fence', 'owner', 'le', 'nb', 'id', 'v', 'n')
local live = f[2] and f[2] ~= ARGV[1] and num(f[3]) > now
if live and ARGV[3] ~= '1' then return {-1, now, f[2], num(f[3]) - now} end
local id = f[5]
if ARGV[3] ~= '1' then
  local empty = num(f[7]) == 0 and (ARGV[5] == '' or ARGV[5] == id)
  if not empty and not (id == ARGV[5] and f[6] == ARGV[6]) then
    return {-2, now, id or '', num(f[6]), num(f[7])}
  end
end
local token = new_token(f[1])
local nb = num(f[4])
if live then
  nb = math.max(nb, num(f[3]))
  redis.call('HSET', KEYS[1], 'nbo', f[2])
end
if not id then
  id = ARGV[7]
  redis.call('HSET', KEYS[1], 'session', ARGV[4], 'id', id, 'v', '0', 'n', '0')
end
redis.call('HSET', KEYS[1], 'fence', token, 'owner', ARGV[1],
           'le', fmt(now + tonumber(ARGV[2])), 'nb', fmt(nb))
redis.call('HDEL', KEYS[1], 'dmg')
return {0, now, token, id, num(f[6]), num(f[7])}
"""
)
"""KEYS: manifest; ARGV: owner, lease ms, force (1/0), session, the manifest id and version
this replica knows ('' and '' for none), a new id (used if there is no manifest yet).
Returns {0, now, token, id, v, n}; {-1, now, holder, ms left}: another replica's lease is
live; {-2, now, id, v, n}: without force, the history is not the one this replica knows.
A token is above the last one and at least the server's clock in microseconds."""

ENSURE = (
    _COMMON
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-4, now} end
local f = redis.call('HMGET', KEYS[1], 'fence', 'id', 'v', 'n', 'dmg')
if f[1] ~= ARGV[3] then return {-1, now, f[1] or '', num(f[5])} end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'le', fmt(now + tonumber(ARGV[2])))
return {0, now, f[2] or '', num(f[3]), num(f[4])}
"""
)
"""KEYS: manifest; ARGV: owner, lease ms, token. Confirms the token and renews the lease:
{0, now, id, v, n}; {-1, now, fence, dmg}: another replica took over (``dmg`` 1: and
then found the history damaged); {-4, now}: no manifest."""

COMMIT = (
    _COMMON
    + """
local seq = ARGV[1]
if redis.call('HGET', KEYS[1], 'k:' .. seq) == ARGV[4] then
  return {1, now, num(redis.call('HGET', KEYS[1], 'v'))}
end
if now > tonumber(ARGV[7]) then return {-5, now} end
local function refuse(code, a, b, c)
  for i = 2, #KEYS do redis.call('UNLINK', KEYS[i]) end
  return {code, now, a or '', b or 0, c or 0}
end
local bn = tonumber(ARGV[12] or '') or 0
if redis.call('EXISTS', KEYS[1]) == 0 then return refuse(-4) end
local f = redis.call('HMGET', KEYS[1], 'fence', 'id', 'v', 'n', 'nb', 'dmg', 'bn')
if f[1] ~= ARGV[2] then return refuse(-1, f[1], num(f[6])) end
if f[4] == '0' and redis.call('EXISTS', ARGV[13 + 2 * bn]) == 1 then return refuse(-9) end
if ARGV[8] == '' and redis.call('HEXISTS', KEYS[1], 'mac') == 1 then return refuse(-7) end
if ARGV[11] ~= '' and ARGV[8] == '' then
  if redis.call('EXISTS', ARGV[11]) == 1 then return refuse(-7) end
  local since = redis.call('GET', ARGV[11] .. ':unmarked')
  if not since then
    since = fmt(now)
    redis.call('SET', ARGV[11] .. ':unmarked', since)
  end
  local left = num(since) + num(ARGV[15 + 2 * bn]) - now
  if left > 0 then return {-10, now, left} end
elseif ARGV[11] ~= '' and ARGV[14 + 2 * bn] ~= '' then
  redis.call('SET', ARGV[11], ARGV[14 + 2 * bn], 'NX')
  redis.call('DEL', ARGV[11] .. ':unmarked')
end
if f[4] == '0' then
  local up = tonumber(string.match(redis.call('INFO', 'server'), 'uptime_in_seconds:(%d+)')) or 0
  local wait = math.floor(num(ARGV[15 + 2 * bn]) / 3) - up * 1000
  if wait > 0 then return {-11, now, wait} end
end
local next_seq = seq
if bn > 0 then
  if tonumber(seq) ~= bn or f[7] then next_seq = '' else next_seq = '0' end
end
if f[2] ~= ARGV[5] or f[3] ~= ARGV[6] or f[4] ~= next_seq then
  return refuse(-2, f[2], num(f[3]), num(f[4]))
end
if num(f[5]) > now then
  return {-3, now, num(f[5]) - now, redis.call('HGET', KEYS[1], 'nbo') or ''}
end
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return {-6, now, KEYS[i]} end
end
for i = 1, bn do
  local base, rseq, nonce, np = string.match(ARGV[12 + i], '^(.*):(%d+):(%x+):(%d+)$')
  if not base then return refuse(-8, ARGV[12 + i]) end
  for p = 0, tonumber(np) - 1 do
    if redis.call('PTTL', base .. ':' .. rseq .. ':' .. nonce .. ':' .. p) ~= -1 then
      return refuse(-8, ARGV[12 + i])
    end
  end
end
for i = 2, #KEYS do redis.call('PERSIST', KEYS[i]) end
for i = 1, bn do
  local base, rseq, nonce = string.match(ARGV[12 + i], '^(.*):(%d+):(%x+):%d+$')
  redis.call('SADD', base .. ':' .. rseq .. ':' .. nonce .. ':r', KEYS[1])
  redis.call('HSET', KEYS[1], 'q:' .. (i - 1), ARGV[12 + i], 'r:' .. (i - 1), ARGV[12 + bn + i])
end
if bn > 0 then redis.call('HSET', KEYS[1], 'bn', fmt(bn)) end
local v = num(f[3]) + 1
redis.call('HSET', KEYS[1], 'e:' .. seq, ARGV[3], 'k:' .. seq, ARGV[4], 'n', fmt(tonumber(seq) + 1),
           'v', fmt(v), 'owner', ARGV[9], 'le', fmt(now + tonumber(ARGV[10])))
if ARGV[8] ~= '' then redis.call('HSET', KEYS[1], 'mac', ARGV[8])
else redis.call('HDEL', KEYS[1], 'mac') end
return {0, now, v}
"""
)
"""KEYS: manifest, parts...; ARGV: seq, token, entry, nonce:parts, manifest id and version
the writer extends, deadline (server ms), the new manifest MAC (''), owner, lease ms, the
key of the prefix's authentication mark ('' on a Cluster, where it lies in another slot),
then ``bn``, the number of segments a fork's first turn references ('0' for none), its
``bn`` ``q:<i>`` values, its ``bn`` ``r:<i>`` values, the conversation's retired set (its
keys' base and ``:t``), the mark (a writer with a secret; '' without one) and the settling
period in ms (see below).

The prefix's mark: a writer with a secret puts it back if it is gone (a server that
restarted empty forgot it, or evicted it), and removes ``<mark key>:unmarked``. A writer
without a secret is refused while the prefix is marked (-7), and, so that a server that
forgot the mark cannot let it write before the replicas with the secret mark the prefix
again (their heartbeat does, every third of their liveness), it commits only once the
prefix has been seen unmarked for the settling period (``<mark key>:unmarked`` holds
since when, server ms; a replica opening without a secret on a server up for that long
sets it that far back): {-10, now, ms left} until then (its parts are kept, for the same
commit later).

A fork's first turn (``bn`` > 0, ``seq`` = ``bn``, an empty manifest) is committed with
its references only if every part of every referenced segment is there and committed (no
expiry): the parent's range is the one the fork names, or the commit leaves no trace
({-8, now, q}). It adds the fork's manifest key to each referenced segment's reference
set (``<base>:<seq>:<nonce>:r``) in the same step. A conversation's first commit is
refused while its retired set holds segments that forks still list ({-9, now}: the key
cannot start a new history yet).

Commits segment ``seq`` only if the token is the current fence, the manifest is the
version the writer extends and ``seq`` is its next segment, no takeover delay is pending,
every part is there, and the server's clock has not passed the deadline (after which the
writer has stopped waiting: a request the server runs later is refused, so it can never
commit behind the writer's back). Returns {0, now, v} (committed), {1, now, v} (this very
segment was committed before: a retry), or a refusal: {-1, now, fence, dmg} (another
writer; ``dmg`` 1: it then found the history damaged),
{-2, now, id, v, n} (another history), {-3, now, ms, holder} (takeover delay, until the
lease of ``holder`` would have ended), {-10, now, ms} (settling, above), {-11, now, ms} (a
history's first commit on a server up for less than a liveness period, a third of the
settling period: after an empty restart, a replica whose lease the server forgot may still
serve its own copy until its heartbeat, which then finds its liveness key gone, or its
liveness runs out), {-4, now} (no
manifest), {-5, now} (past the deadline), {-6, now, part} (a part is missing), {-7, now}
(a writer without a MAC, ``ARGV[8]`` empty, extending an authenticated history, or
writing under a prefix marked authenticated), -8 and -9 (above). Refusals
-1, -2, -4, -7, -8 and -9 unlink the given parts (they are this write's own, referenced by
nothing)."""

DROP = (
    _COMMON
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, now} end
local f = redis.call('HMGET', KEYS[1], 'fence', 'id', 'v')
if ARGV[1] == 'discard' then
  if f[1] ~= ARGV[2] then return {-1, now, f[1] or ''} end
elseif f[2] ~= ARGV[3] or f[3] ~= ARGV[2] then
  return {0, now}
end
local function unlink(base, seq, nonce, n)
  for i = 0, tonumber(n) - 1 do
    redis.call('UNLINK', base .. ':' .. seq .. ':' .. nonce .. ':' .. i)
  end
end
for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
  local seq = string.match(field, '^k:(%d+)$')
  if seq then
    local nonce, n = string.match(redis.call('HGET', KEYS[1], field), '^(%x+):(%d+)$')
    if nonce then
      if redis.call('EXISTS', ARGV[4] .. ':' .. seq .. ':' .. nonce .. ':r') == 1 then
        redis.call('SADD', ARGV[4] .. ':t', seq .. ':' .. nonce .. ':' .. n)
      else
        unlink(ARGV[4], seq, nonce, n)
      end
    end
    redis.call('HDEL', KEYS[1], field)
  elseif string.match(field, '^q:') then
    local q = redis.call('HGET', KEYS[1], field)
    local base, rseq, nonce, n = string.match(q, '^(.*):(%d+):(%x+):(%d+)$')
    if base then
      local refs = base .. ':' .. rseq .. ':' .. nonce .. ':r'
      redis.call('SREM', refs, KEYS[1])
      if redis.call('EXISTS', refs) == 0
         and redis.call('HGET', base .. ':m', 'k:' .. rseq) ~= nonce .. ':' .. n then
        unlink(base, rseq, nonce, n)
        redis.call('SREM', base .. ':t', rseq .. ':' .. nonce .. ':' .. n)
      end
    end
    redis.call('HDEL', KEYS[1], field)
  elseif string.match(field, '^[er]:') or field == 'bn' then
    redis.call('HDEL', KEYS[1], field)
  end
end
local v = num(f[3]) + 1
if ARGV[1] == 'discard' then
  redis.call('DEL', KEYS[1])
  return {1, now, v}
end
redis.call('HSET', KEYS[1], 'n', '0', 'v', fmt(v), 'id', ARGV[5], 'dmg', '1')
redis.call('HDEL', KEYS[1], 'mac')
return {1, now, v}
"""
)
"""KEYS: manifest; ARGV: 'discard' and the writer's token, or 'damaged' and the version
found damaged; the manifest id found damaged (unused for a discard); the keys' base; a
new manifest id. Removes every segment (values included), but for one that forks still
list (its reference set is not empty): that one stays, recorded in the conversation's
retired set (``<base>:t``), until its last fork leaves. A fork's references go too: it
leaves each referenced segment's reference set, and the last one to leave a segment its
owner no longer lists deletes it (and its place in the owner's retired set).

A discard (only by the current
writer: {-1, now, fence} otherwise) removes the manifest too: nothing of the conversation
stays on the server (a writer that still holds a token finds no manifest and is refused;
a later writer's token is still larger, being at least the server's clock). A damaged
history (only in the version that was found damaged: a later one is left alone) keeps an
empty manifest under a new version and incarnation id (so no value of the old one can be
put back), marked ``dmg`` until the next writer takes it, so its writer learns why it was
refused. Returns {1, now, v} when it removed them, {0, now} when there was nothing to do.

A fork's references name keys in other conversations' slots: forks need one server (not a
Cluster)."""

RECLAIM = (
    _COMMON
    + """
if redis.call('HGET', KEYS[1], 'nbo') == ARGV[1] and num(redis.call('HGET', KEYS[1], 'nb')) > now
then
  redis.call('HSET', KEYS[1], 'nb', fmt(now))
  return {1, now}
end
return {0, now}
"""
)
"""KEYS: manifest; ARGV: the replica whose lease a takeover waits for, found dead (its
liveness key gone). Ends the takeover delay now: {1, now}; {0, now}: nothing to end (no
delay, or one for another replica's lease)."""

RELEASE = (
    _COMMON
    + """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'le', '0')
  return {1, now}
end
return {0, now}
"""
)
"""KEYS: manifest; ARGV: owner. Ends this replica's lease (its token stays the fence until
another replica takes the conversation, which then needs no delay)."""

SETTLE = (
    _COMMON
    + """
if redis.call('EXISTS', ARGV[1]) == 1 then return {1, now} end
local up = tonumber(string.match(redis.call('INFO', 'server'), 'uptime_in_seconds:(%d+)')) or 0
local settle = tonumber(ARGV[2])
if up * 1000 < settle then return {2, now, settle - up * 1000} end
redis.call('SET', ARGV[1] .. ':unmarked', fmt(now - settle), 'NX')
return {0, now}
"""
)
"""KEYS: none (one server only); ARGV: the key of the prefix's authentication mark, the
settling period (ms). For a writer without a secret, at open: {1, now} the prefix is
marked; {2, now, ms}: the server has been up for less than the settling period (it may have
restarted empty, forgetting the mark, which the replicas with the secret have not put back
yet): ask again in ``ms``; {0, now}: unmarked on a server up that long, so unmarked that
long (a mark is only ever lost with everything else, or evicted, when the replicas with the
secret remove ``:unmarked`` as they mark again): ``<mark key>:unmarked`` says so (if it was
not set already), and this replica's commits need not wait (see ``COMMIT``)."""
