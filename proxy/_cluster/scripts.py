"""The Lua scripts of cluster mode (pure text; run by :mod:`proxy._cluster.store`).

Each script touches the keys of one session only (one hash slot, see
:mod:`proxy._cluster.keys`), and reads time from Redis (``TIME``), never from a
node, so deadlines written by nodes whose clocks disagree stay comparable.
Redis runs a script atomically (https://redis.io/docs/latest/develop/interact/
programmability/eval-intro/): no other command sees it half done, which is
what makes "tombstone check + in-flight registration" one admission decision.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ADMIT",
    "BEGIN_CLOSE",
    "DEREGISTER",
    "LEDGER_GATE",
    "LEDGER_GATE_RUN",
    "LEDGER_MARK_CLEAN",
    "PRUNE",
    "REFRESH",
]

_NOW: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Keep the set alive for twice its newest deadline: a set whose every node died
# vanishes by itself, but only after a closer waiting timeout + TTL had the chance
# to count those entries as expired. PTTL -1 (no expiry yet) or shorter: extend.
_KEEP: Final = """
local left = redis.call('PTTL', KEYS[2])
if left < 2 * ttl then redis.call('PEXPIRE', KEYS[2], 2 * ttl) end
"""

ADMIT: Final = (
    """
-- KEYS: tombstone, in_flight. ARGV: member, ttl_ms.
-- Returns {1, 0} admitted, or {0, ms} refused: the tombstone's PTTL (-1: no expiry).
local left = redis.call('PTTL', KEYS[1])
if left ~= -2 then return {0, left} end
"""
    + _NOW
    + """
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
"""
    + _KEEP
    + """
return {1, 0}
"""
)

DEREGISTER: Final = """
-- KEYS: tombstone, in_flight, tally. ARGV: member, 'finished' | 'cancelled'.
-- An exchange leaving while its session is tombstoned was in flight when the close
-- began (admission refuses after the tombstone): it counts in the close's tally.
local removed = redis.call('ZREM', KEYS[2], ARGV[1])
if removed == 1 and redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HINCRBY', KEYS[3], ARGV[2], 1)
end
return removed
"""

REFRESH: Final = (
    """
-- KEYS: unused, in_flight. ARGV: ttl_ms, mode ('XX': heartbeat, only entries still
-- there; '': reconcile, re-add), members...
"""
    + _NOW
    + """
local ttl = tonumber(ARGV[1])
local n = 0
for i = 3, #ARGV do
  if ARGV[2] == 'XX' then
    n = n + redis.call('ZADD', KEYS[2], 'XX', 'CH', now + ttl, ARGV[i])
  else
    n = n + redis.call('ZADD', KEYS[2], 'CH', now + ttl, ARGV[i])
  end
end
if redis.call('EXISTS', KEYS[2]) == 1 then
"""
    + _KEEP
    + """
end
return n
"""
)

BEGIN_CLOSE: Final = """
-- KEYS: tombstone, tally. ARGV: close_id, tombstone_ttl_ms.
-- Returns {1, close_id} for a new close, {0, existing_id, done} when the session is
-- tombstoned already (a close in progress, or one that completed within the TTL).
local existing = redis.call('GET', KEYS[1])
if existing then
  return {0, existing, tonumber(redis.call('HGET', KEYS[2], 'done') or '1')}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'finished', 0, 'cancelled', 0, 'expired', 0, 'done', 0)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return {1, ARGV[1], 0}
"""

PRUNE: Final = (
    """
-- KEYS: in_flight, tally. Drops entries past their deadline (their node stopped
-- heartbeating: dead or cut off), counts them as expired, returns what is left.
"""
    + _NOW
    + """
local expired = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if expired > 0 and redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], 'expired', expired)
end
return redis.call('ZCARD', KEYS[1])
"""
)

LEDGER_GATE: Final = """
-- KEYS: ledger. ARGV: digest, comparable ('1'|'0'), request_bytes, response_bytes,
-- last_activity (seconds, as text).
-- The hash gate of docs/design.md §5, atomic across nodes. Returns
-- {outcome, revision_epoch, dirty}: outcome 'first' | 'identical' | 'reformat' | 'revision'.
-- last_activity only moves forward (the SQLite ledger's max()): commits from several
-- nodes, or a slow one from this node, may arrive after a newer exchange's.
local saved = redis.call('HMGET', KEYS[1], 'digest', 'comparable', 'revision_epoch', 'dirty',
                         'last_activity')
local outcome
if not saved[1] then
  outcome = 'first'
  redis.call('HSET', KEYS[1], 'digest', ARGV[1], 'comparable', ARGV[2],
             'revision_epoch', 0, 'dirty', 0)
elseif saved[1] == ARGV[1] then
  outcome = 'identical'
elseif saved[2] == ARGV[2] then
  outcome = 'reformat'
  redis.call('HSET', KEYS[1], 'digest', ARGV[1])
else
  outcome = 'revision'
  redis.call('HSET', KEYS[1], 'digest', ARGV[1], 'comparable', ARGV[2], 'dirty', 1)
  redis.call('HINCRBY', KEYS[1], 'revision_epoch', 1)
end
if outcome ~= 'identical' then
  redis.call('HINCRBY', KEYS[1], 'requests', 1)
  redis.call('HINCRBY', KEYS[1], 'bytes_in', ARGV[3])
  redis.call('HINCRBY', KEYS[1], 'bytes_out', ARGV[4])
  local seen = tonumber(saved[5])
  if not seen or tonumber(ARGV[5]) > seen then
    redis.call('HSET', KEYS[1], 'last_activity', ARGV[5])
  end
end
local now = redis.call('HMGET', KEYS[1], 'revision_epoch', 'dirty')
return {outcome, tonumber(now[1]), tonumber(now[2])}
"""

LEDGER_MARK_CLEAN: Final = """
-- KEYS: ledger. ARGV: epoch ('' for any). Clears dirty if set and, with an epoch,
-- only at that revision_epoch (a flip during the consumer's rebuild keeps it dirty).
local saved = redis.call('HMGET', KEYS[1], 'dirty', 'revision_epoch')
if saved[1] ~= '1' then return 0 end
if ARGV[1] ~= '' and saved[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'dirty', 0)
return 1
"""

LEDGER_GATE_RUN: Final = """
-- KEYS: ledger. ARGV: the run's first commit as LEDGER_GATE takes it (digest, comparable,
-- request_bytes, response_bytes, last_activity), then the rest of the run (requests,
-- bytes_in, bytes_out, flips, digest, comparable, last_activity): see proxy.GateRun;
-- then the sender's field and the run's sequence number. One pass of the whole run,
-- atomic. last_activity only moves forward. A run is applied at most once: the
-- sender's field holds the newest sequence number it applied, and a run resent after
-- a timeout (Redis may have run the first copy) at or below it changes nothing.
-- Returns {outcome of the first commit, revision_epoch, dirty, 1 if a duplicate}.
local done = redis.call('HGET', KEYS[1], ARGV[13])
if done and tonumber(done) >= tonumber(ARGV[14]) then
  local now = redis.call('HMGET', KEYS[1], 'revision_epoch', 'dirty')
  return {'identical', tonumber(now[1]), tonumber(now[2]), 1}
end
local saved = redis.call('HMGET', KEYS[1], 'digest', 'comparable', 'last_activity')
local outcome
if not saved[1] then
  outcome = 'first'
  redis.call('HSET', KEYS[1], 'digest', ARGV[1], 'comparable', ARGV[2],
             'revision_epoch', 0, 'dirty', 0)
elseif saved[1] == ARGV[1] then
  outcome = 'identical'
elseif saved[2] == ARGV[2] then
  outcome = 'reformat'
  redis.call('HSET', KEYS[1], 'digest', ARGV[1])
else
  outcome = 'revision'
  redis.call('HSET', KEYS[1], 'digest', ARGV[1], 'comparable', ARGV[2], 'dirty', 1)
  redis.call('HINCRBY', KEYS[1], 'revision_epoch', 1)
end
local requests = tonumber(ARGV[6])
local bytes_in = tonumber(ARGV[7])
local bytes_out = tonumber(ARGV[8])
local newest = nil
if outcome ~= 'identical' then
  requests = requests + 1
  bytes_in = bytes_in + tonumber(ARGV[3])
  bytes_out = bytes_out + tonumber(ARGV[4])
  newest = ARGV[5]
end
if tonumber(ARGV[6]) > 0 then
  redis.call('HSET', KEYS[1], 'digest', ARGV[10], 'comparable', ARGV[11])
  local flips = tonumber(ARGV[9])
  if flips > 0 then
    redis.call('HINCRBY', KEYS[1], 'revision_epoch', flips)
    redis.call('HSET', KEYS[1], 'dirty', 1)
  end
  if newest == nil or tonumber(ARGV[12]) > tonumber(newest) then newest = ARGV[12] end
end
if requests > 0 then
  redis.call('HINCRBY', KEYS[1], 'requests', requests)
  redis.call('HINCRBY', KEYS[1], 'bytes_in', bytes_in)
  redis.call('HINCRBY', KEYS[1], 'bytes_out', bytes_out)
  if not saved[3] or tonumber(newest) > tonumber(saved[3]) then
    redis.call('HSET', KEYS[1], 'last_activity', newest)
  end
end
if outcome ~= 'identical' or requests > 0 then
  redis.call('HSET', KEYS[1], ARGV[13], ARGV[14])
end
local now = redis.call('HMGET', KEYS[1], 'revision_epoch', 'dirty')
return {outcome, tonumber(now[1]), tonumber(now[2]), 0}
"""
