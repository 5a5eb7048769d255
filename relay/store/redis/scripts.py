"""The Redis store's Lua scripts and the codec of the values they write.

Values under a key (the caller builds the key, prefix included)::

    P|<token>[#<d>]                  PENDING of the attempt holding <token>, TTL = lease
    D|<token>[#<d>]|<unix_ms>|<lease_ms>
                                     SENDING: the attempt's final dot is going out; <unix_ms> its
                                     last heartbeat, <lease_ms> its lease (``D|<token>|<unix_ms>``
                                     of earlier versions: the reader's lease), TTL = dedup window
    0[#<d>]                          SENT, TTL = dedup window: the send time is the expiry
                                     time less the window (:func:`decode_value`); ``0`` is
                                     one of Redis's shared integers, so the record holds no
                                     value allocation of its own (the upstream's reply is in
                                     the relay's log line, not in the store); ``0#<d>``, 12
                                     bytes, fits the smallest allocation of an embedded string
    S|<unix_ms>[#<d>]|<reply text>   SENT at <unix_ms>, TTL = dedup window: written by earlier
                                     versions, by ``mark-sent`` (the operator's text), and by
                                     a settle whose window is not the store's (empty text)
    U|<unix_ms>[#<d>]                UNKNOWN since <unix_ms>, TTL = dedup window
    anything else (e.g. ``1``)       written by another application: counts as SENT, time
                                     unknown

``#<d>`` is the stored digest of the content of the message whose reserve wrote the record
(design.md §2.2: ten characters of ``[A-Za-z0-9_-]``), carried by every script from PENDING
through SENDING to SENT or UNKNOWN; a value without one (written by an earlier version) never
counts as a key reused (§4.9). It sits where an earlier version reads it harmlessly: inside the
token of PENDING and SENDING (still the same state, in flight, judged by its heartbeat), and
after the time of SENT and UNKNOWN (a value such a version does not know: SENT, time unknown).

Each script touches ``KEYS[1]`` only, so the store works on Redis Cluster without hash tags.
"""

from __future__ import annotations

import dataclasses
import re

from relay.core.interfaces import Record, State
from relay.core.rules import sending_record

# Every time a script records or compares comes from the Redis server's own clock (TIME), never
# from a relay's: relays on hosts whose clocks disagree then still agree on a record's age (a
# SENDING record older than the lease is in doubt). On a cluster each key lives on one node, so
# its every timestamp comes from that node's clock. Scripts are replicated by their effects
# (Redis >= 5 default, the only mode of Redis 7), so calling TIME before a write is allowed.
NOW_MS_LUA = """
local function now_ms()
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# The server-side twin of relay.core.rules.heartbeat_state, which is the reference (a test
# runs the rule's table through both): whether ``value`` is a SENDING record in doubt at
# ``now`` (unix ms, the server's), its last heartbeat its own lease old (``D|token|ms|lease``)
# or ``lease`` old (ms, the reader's: ``D|token|ms``); false for any other value
SENDING_IN_DOUBT_LUA = """
local function sending_in_doubt(value, now, lease)
    local sending_at, own = string.match(value, '^D|[^|]+|(%d+)|(%d+)$')
    if not sending_at then
        sending_at, own = string.match(value, '^D|[^|]+|(%d+)$'), lease
    end
    return sending_at ~= nil and now - tonumber(sending_at) >= tonumber(own)
end
"""

# The content digest a value carries ("#" and its characters, DIGEST_CHARS), or nil: the
# server-side reader of the ``#<d>`` of every relay value (see the module docstring)
DIGEST_OF_LUA = """
local function digest_of(value)
    return string.match(value, '^[PD]|[^|#]*(#[%w_-]+)')
        or string.match(value, '^0(#[%w_-]+)$')
        or string.match(value, '^S|%d+(#[%w_-]+)|')
        or string.match(value, '^U|%d+(#[%w_-]+)$')
end
"""

# The server-side twin of relay.core.rules.takes_over, which is the reference (the store
# contract runs its table through every store): whether a reserve replaces ``value`` (found at
# ``now``, unix ms) with its own PENDING. ``lease`` (ms) judges a SENDING record without a lease
# of its own; ``resend`` "1": unknown_policy = send (a record in doubt: UNKNOWN, or SENDING not
# renewed for its lease); ``replace`` "1": key_reuse = relay (a SENT or in-doubt record of the
# relay's whose digest differs from ``mine``, the reserve's "#<d>"; "" for a message without
# one). A record in flight never, nor a value without a digest (an earlier version's, another
# application's)
TAKES_OVER_LUA = SENDING_IN_DOUBT_LUA + DIGEST_OF_LUA + """
local function takes_over(value, now, lease, resend, replace, mine)
    local in_doubt = string.match(value, '^U|%d+$') ~= nil
        or string.match(value, '^U|%d+#[%w_-]+$') ~= nil
        or sending_in_doubt(value, now, lease)
    if resend == '1' and in_doubt then
        return true
    end
    if replace ~= '1' or mine == '' then
        return false
    end
    local theirs = digest_of(value)
    if theirs == nil or theirs == mine then
        return false
    end
    return in_doubt or string.sub(value, 1, 1) == '0' or string.sub(value, 1, 2) == 'S|'
end
"""

# KEYS[1] - the fingerprint key
# ARGV[1] - the attempt's token
# ARGV[2] - the lease in milliseconds
# ARGV[3] - "1": take over a record in doubt (unknown_policy = send), else "0"
# ARGV[4] - the message's content digest as stored: "#" and its characters; "" for none
# ARGV[5] - "1": take over a SENT or in-doubt record of other content (key_reuse = relay)
# return 1 if KEYS[1] now holds PENDING(token) ("P|" .. token .. ARGV[4]) of this attempt:
# created now, or by an earlier call with the same token (so a retried reserve is idempotent);
# otherwise {value, pttl, took_over, now}: the value found ("" when the key holds a non-string
# type), its remaining lifetime in milliseconds (-1: no expiry), 1 when takes_over replaced it
# by PENDING(token) else 0, and the server's time in unix milliseconds (so the caller can tell
# a SENDING record's age)
RESERVE_LUA = NOW_MS_LUA + TAKES_OVER_LUA + """
local mine = 'P|' .. ARGV[1] .. (ARGV[4] or '')
if redis.call('SET', KEYS[1], mine, 'NX', 'PX', ARGV[2]) then
    return 1
end
local value = redis.pcall('GET', KEYS[1])
if type(value) ~= 'string' then
    value = ''
end
if value == mine then
    return 1
end
local pttl = redis.call('PTTL', KEYS[1])
local now = now_ms()
if takes_over(value, now, ARGV[2], ARGV[3], ARGV[5] or '0', ARGV[4] or '') then
    redis.call('SET', KEYS[1], mine, 'PX', ARGV[2])
    return {value, pttl, 1, now}
end
return {value, pttl, 0, now}
"""

# The guard every settle and renewal starts with: KEYS[1] must hold PENDING(ARGV[1]) or
# SENDING(ARGV[1], ...) of this attempt, else the script returns 0 and changes nothing.
# ``mark`` is the record's "#<d>" ("" for none): every value the script writes carries it.
OURS_LUA = """
local value = redis.pcall('GET', KEYS[1])
if type(value) ~= 'string' then
    return 0
end
local tag, owner, mark = string.match(value, '^([PD])|([^|#]*)(#?[%w_-]*)')
local pending = tag == 'P' and owner == ARGV[1] and value == 'P|' .. owner .. mark
local is_sending = tag == 'D' and owner == ARGV[1]
    and string.sub(value, #owner + #mark + 3, #owner + #mark + 3) == '|'
if not pending and not is_sending then
    return 0
end
"""

# A settle that ends an attempt's hold on KEYS[1] announces it on the key's channel (PUBLISH
# SETTLED_CHANNEL .. KEYS[1]), for the copies waiting for it (relay.store.redis.settled)
SETTLED_CHANNEL = "settled:"
PUBLISH_LUA = f"redis.call('PUBLISH', '{SETTLED_CHANNEL}' .. KEYS[1], '1')\n"

# KEYS[1] - the fingerprint key
# ARGV[1] - the attempt's token
# ARGV[2] - the dedup window in milliseconds (TTL of the SENT value)
# ARGV[3] - "1": the readers' window (write "0", dated by its expiry); "0": another window
#           (write "S|<now ms>|", dated by itself)
# return 1 if KEYS[1] held PENDING(token) or SENDING(token) and now holds SENT, expiring a
# window from the server's time, otherwise 0 (nothing changed)
MARK_SENT_LUA = NOW_MS_LUA + OURS_LUA + """
local sent = '0' .. mark
if ARGV[3] ~= '1' then
    sent = 'S|' .. now_ms() .. mark .. '|'
end
redis.call('SET', KEYS[1], sent, 'PX', ARGV[2])
""" + PUBLISH_LUA + """return 1
"""

# KEYS[1] - the fingerprint key
# ARGV[1] - the attempt's token
# ARGV[2] - the dedup window in milliseconds (TTL of the UNKNOWN value)
# return 1 if KEYS[1] held PENDING(token) or SENDING(token) and now holds UNKNOWN since the
# server's time, otherwise 0 (nothing changed)
MARK_UNKNOWN_LUA = NOW_MS_LUA + OURS_LUA + """
redis.call('SET', KEYS[1], 'U|' .. now_ms() .. mark, 'PX', ARGV[2])
""" + PUBLISH_LUA + """return 1
"""

# KEYS[1] - the fingerprint key
# ARGV[1] - the attempt's token
# return 1 if KEYS[1] held PENDING(token) or SENDING(token) and was deleted, otherwise 0
RELEASE_LUA = OURS_LUA + """
redis.call('DEL', KEYS[1])
""" + PUBLISH_LUA + """return 1
"""

# KEYS[1] - the fingerprint key
# ARGV[1] - the attempt's token
# ARGV[2] - the dedup window in milliseconds (TTL of the SENDING value: it must outlive a crash)
# ARGV[3] - the attempt's lease in milliseconds (kept in the value: readers judge by it); "0":
#           none kept (readers judge by their own lease)
# return 1 if KEYS[1] holds SENDING(token, now, lease) ("D|" .. token .. mark .. "|" .. ms ..
# "|" .. lease, the server's time) after the call: it held PENDING(token), or already
# SENDING(token) (a retried call is idempotent); otherwise 0 (nothing changed)
MARK_SENDING_LUA = NOW_MS_LUA + OURS_LUA + """
if is_sending then
    return 1
end
local lease = ''
if ARGV[3] ~= '0' then
    lease = '|' .. ARGV[3]
end
redis.call('SET', KEYS[1], 'D|' .. ARGV[1] .. mark .. '|' .. now_ms() .. lease, 'PX', ARGV[2])
return 1
"""

# KEYS[1] - the fingerprint key
# ARGV[1] - the attempt's token
# ARGV[2] - the lease in milliseconds
# ARGV[3] - the dedup window in milliseconds ("0": keep a SENDING record's TTL)
# return 1 if the attempt still holds KEYS[1] and its lease was renewed: PENDING(token) gets a
# TTL of the lease again; SENDING(token) gets the server's time as its heartbeat (a SENDING record
# not renewed for its lease is in doubt) and the lease, and a TTL of at least the window (a
# transfer longer than the window keeps its record); otherwise 0 (nothing changed: the key is
# no longer this attempt's)
RENEW_LUA = NOW_MS_LUA + OURS_LUA + """
if pending then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
else
    local value = 'D|' .. ARGV[1] .. mark .. '|' .. now_ms() .. '|' .. ARGV[2]
    local window = tonumber(ARGV[3] or '0')
    if window > 0 and redis.call('PTTL', KEYS[1]) < window then
        redis.call('SET', KEYS[1], value, 'PX', window)
    else
        redis.call('SET', KEYS[1], value, 'KEEPTTL')
    end
end
return 1
"""

# KEYS[1] - the fingerprint key
# ARGV[1] - the upstream reply text an operator gives
# ARGV[2] - the dedup window in milliseconds
# ARGV[3] - "value": only while KEYS[1] holds exactly ARGV[4] (the value the operator saw; ""
#           for a key of another type, as INSPECT_LUA reads it); "absent": only while it holds
#           nothing; "any": whatever it holds
# ARGV[4] - the value the operator saw (with "value")
# return 1 if KEYS[1] now holds SENT at the server's time (an operator's decision), 0 if it
# no longer held what the operator saw (nothing changed: a retry took the key meanwhile)
FORCE_SENT_LUA = NOW_MS_LUA + """
local value = redis.pcall('GET', KEYS[1])
if value ~= false and type(value) ~= 'string' then
    value = ''
end
if (ARGV[3] == 'absent' and value ~= false) or (ARGV[3] == 'value' and value ~= ARGV[4]) then
    return 0
end
redis.call('SET', KEYS[1], 'S|' .. now_ms() .. '|' .. ARGV[1], 'PX', ARGV[2])
""" + PUBLISH_LUA + """return 1
"""

# KEYS[1] - the fingerprint key
# return {value, pttl, now}: the value (0 when the key is absent, "" when it holds a non-string
# type), its remaining lifetime in milliseconds, and the server's time in unix milliseconds (so
# a record's age is the server's, never the reader's clock)
INSPECT_LUA = NOW_MS_LUA + """
local value = redis.pcall('GET', KEYS[1])
if value == false then
    return {0, -2, now_ms()}
end
if type(value) ~= 'string' then
    value = ''
end
return {value, redis.call('PTTL', KEYS[1]), now_ms()}
"""

# KEYS[1] - the fingerprint key
# ARGV[1] - "1": delete only if KEYS[1] holds exactly ARGV[2]; "0": whatever it holds
# ARGV[2] - the value the operator saw
# return 1 if KEYS[1] was deleted, 0 otherwise
RELEASE_IF_LUA = """
if ARGV[1] == '1' and redis.pcall('GET', KEYS[1]) ~= ARGV[2] then
    return 0
end
local deleted = redis.call('DEL', KEYS[1])
""" + PUBLISH_LUA + """return deleted
"""

def reply_bytes(reply: str) -> bytes:
    """Encode an upstream reply as UTF-8, replacing what cannot be encoded (lone surrogates)."""
    return reply.encode("utf-8", "replace")


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


SENT_VALUE = b"0"
"""The SENT record the relay writes (see the module docstring), without a digest."""
_DIGEST = re.compile(rb"#([A-Za-z0-9_-]+)\Z")


def digest_mark(content_digest: str) -> bytes:
    """What a value carries of a stored content digest: ``#`` and its characters (``b""``
    for none). Raises ``ValueError`` for a digest outside ``[A-Za-z0-9_-]``."""
    if not content_digest:
        return b""
    mark = b"#" + content_digest.encode("ascii")
    if _DIGEST.fullmatch(mark) is None:
        raise ValueError(f"a stored content digest is [A-Za-z0-9_-]+, not {content_digest!r}")
    return mark


def _split(field: bytes) -> tuple[bytes, str | None]:
    """A field of a value and the content digest it ends with (``<field>#<d>``), if any."""
    head, sep, tail = field.partition(b"#")
    if sep and _DIGEST.fullmatch(sep + tail):
        return head, tail.decode("ascii")
    return field, None


def relay_sent(value: bytes) -> bool:
    """Whether ``value`` is a SENT record the relay wrote dated by its expiry (``0``,
    ``0#<d>``): a SENT value without a time that is no foreign one."""
    head, _digest = _split(value)
    return head == SENT_VALUE


def decode_value(value: bytes, pttl_ms: int | None = None, *,
                 lease_ms: int | None = None, now_ms: int | None = None,
                 window_ms: int | None = None) -> Record:
    """Turn a raw value and its PTTL (milliseconds, negative: none) into a :class:`Record`.

    A value that is not one of the relay's encodings counts as SENT with ``at`` and ``reply``
    unknown (design.md §3). With ``lease_ms`` and ``now_ms`` (a reserve), SENDING reads as
    PENDING while younger than the lease and as UNKNOWN after it. :data:`SENT_VALUE` is SENT
    at ``now_ms + pttl_ms - window_ms`` (unix ms, the server's clock; never later than
    ``now_ms``) when all three are known, else at an unknown time. Never raises.
    """
    ttl_s = pttl_ms / 1000 if pttl_ms is not None and pttl_ms >= 0 else None
    head, digest = _split(value)
    if head == SENT_VALUE:
        return Record(State.SENT, at=_sent_at(pttl_ms, now_ms, window_ms), ttl_s=ttl_s,
                      content_digest=digest)
    tag, sep, rest = value.partition(b"|")
    if sep and tag == b"P" and rest:
        token, digest = _split(rest)
        if token:
            return Record(State.PENDING, token=_text(token), ttl_s=ttl_s, content_digest=digest)
    if sep and tag == b"D":
        first, *numbers = rest.split(b"|")
        token, digest = _split(first)
        if token and 1 <= len(numbers) <= 2 and all(n.isdigit() for n in numbers):
            own_lease_ms = int(numbers[1]) if len(numbers) == 2 else None
            return dataclasses.replace(_sending(
                _text(token), int(numbers[0]), ttl_s,
                own_lease_ms if own_lease_ms is not None else lease_ms,
                now_ms if lease_ms is not None else None, own_lease_ms), content_digest=digest)
    if sep and tag == b"S":
        first, sep2, reply = rest.partition(b"|")
        at_ms, digest = _split(first)
        if sep2 and at_ms.isdigit():
            return Record(State.SENT, at=int(at_ms) / 1000, reply=_text(reply) or None,
                          ttl_s=ttl_s, content_digest=digest)
    if sep and tag == b"U":
        at_ms, digest = _split(rest)
        if at_ms.isdigit():
            return Record(State.UNKNOWN, at=int(at_ms) / 1000, ttl_s=ttl_s,
                          content_digest=digest)
    return Record(State.SENT, ttl_s=ttl_s)


def _sent_at(pttl_ms: int | None, now_ms: int | None, window_ms: int | None) -> float | None:
    """The send time (unix seconds) of a SENT record written with a TTL of ``window_ms``."""
    if pttl_ms is None or pttl_ms < 0 or now_ms is None or window_ms is None:
        return None
    return min(now_ms, now_ms + pttl_ms - window_ms) / 1000


def _sending(token: str, at_ms: int, ttl_s: float | None, lease_ms: int | None,
             now_ms: int | None, own_lease_ms: int | None = None) -> Record:
    """SENDING as such (inspect), or as a reserve sees it: PENDING, or UNKNOWN once
    ``lease_ms`` (the writer's own lease when the record has one) passed since its last
    heartbeat ``at_ms``."""
    judged = lease_ms is not None and now_ms is not None
    return sending_record(
        token=token, at=at_ms / 1000, ttl_s=ttl_s,
        age_s=(now_ms - at_ms) / 1000 if judged and now_ms is not None else None,
        own_lease_s=own_lease_ms / 1000 if own_lease_ms is not None else None,
        lease_s=lease_ms / 1000 if judged and lease_ms is not None else None)
