"""The dedup core: reserve -> partition -> send -> settle -> aggregate reply (design.md §4).

Pure orchestration over the :class:`FingerprintStore`, :class:`Upstream` and :class:`Metrics`
Protocols; it imports no socket, Redis or SMTP library. One :meth:`DedupCore.process` call
handles one message that the listener accepted at the final dot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from relay.core import replies
from relay.core.cancellation import absorb_cancel, run_to_end
from relay.core.errors import InvalidAddressError, InvalidDedupKeyError, StoreError
from relay.core.fingerprint import (
    extract_dedup_headers,
    fingerprint,
    normalize_recipient,
    store_key,
    strip_fields,
)
from relay.core.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    FingerprintStore,
    Metrics,
    NonDelivery,
    Notifier,
    OutboundMessage,
    RcptResult,
    RcptStatus,
    Reservation,
    Settle,
    SettleOp,
    SmtpReply,
    State,
    Upstream,
)
from relay.core.settlement import Settler

log = logging.getLogger("relay.core.dedup")


@dataclass(frozen=True)
class Policy:
    """The dedup rules of one relay (durations in seconds); built from Settings by the app."""

    lease_s: float = 900.0
    window_s: float = 86400.0
    key_prefix: str = "email:fp:"
    key_names: tuple[str, ...] = ("X-Dedupe-Key", "Idempotency-Key")
    template_names: tuple[str, ...] = ("X-Template",)
    max_key_chars: int = 256
    local_part_case_sensitive: bool = False
    secret: bytes | None = None
    missing_key: str = "relay"  # relay | reject
    unknown: str = "suppress"  # suppress | hold | send
    store_down: str = "fail_closed"  # fail_closed | fail_open
    strip_headers: bool = False  # remove the key and template fields before relaying
    scope_by_auth: bool = False  # the AUTH identity is part of the fingerprint (tenants)


@dataclass(frozen=True)
class InboundMessage:
    """A message the listener accepted: envelope, content (unstuffed, CRLF) and trace header.

    ``mail_from`` is ``""`` for the null reverse path; ``trace`` is the ``Received:`` header
    (bytes, CRLF-terminated) prepended to what goes upstream; ``queue_id`` names it in logs.
    """

    mail_from: str
    rcpt_tos: Sequence[str]
    content: bytes
    trace: bytes = b""
    smtputf8: bool = False
    eight_bit: bool = False
    utf8_headers: bool = False
    queue_id: str = ""
    auth_user: str | None = None  # the AUTH identity of the session, when it authenticated


@dataclass(frozen=True)
class Decision:
    """What the core decided: the client ``reply``, one outcome per recipient, a ``result``,
    and each recipient's store key (``keys``; empty for a message without a dedupe key), so an
    operator can find the record of an in-doubt message from its log line."""

    reply: SmtpReply
    result: str
    outcomes: Mapping[str, str] = field(default_factory=dict)
    upstream_reply: SmtpReply | None = None
    keys: Mapping[str, str] = field(default_factory=dict)


# rank of temporary outcomes, worst first (design.md §4.3: "the reply: worst first")
_RANK_STORE_DOWN, _RANK_UNKNOWN, _RANK_REFUSED, _RANK_HELD, _RANK_INFLIGHT = range(5)


@dataclass
class _Tally:
    """Per-recipient outcomes and the replies that decided them, for the aggregate reply."""

    outcomes: dict[str, str] = field(default_factory=dict)
    temp_replies: list[tuple[int, SmtpReply]] = field(default_factory=list)
    perm_replies: list[SmtpReply] = field(default_factory=list)
    perm_results: dict[str, RcptResult] = field(default_factory=dict)  # for the DSN
    first_sent_at: float | None = None

    def add(self, rcpt: str, outcome: str) -> None:
        self.outcomes[rcpt] = outcome

    def temp(self, rcpt: str, outcome: str, rank: int, reply: SmtpReply) -> None:
        self.outcomes[rcpt] = outcome
        self.temp_replies.append((rank, reply))

    def record(self, rcpt: str, result: RcptResult, relayed_outcome: str) -> None:
        """Tally one recipient's upstream result (design.md §4.2)."""
        if result.status is RcptStatus.ACCEPTED:
            self.add(rcpt, relayed_outcome)
        elif result.status is RcptStatus.UNKNOWN:
            self.temp(rcpt, "unknown", _RANK_UNKNOWN, replies.OUTCOME_UNKNOWN)
        elif result.reply.code >= 500:
            self.add(rcpt, "refused_perm")
            self.perm_replies.append(_as_client_reply(result))
            self.perm_results[rcpt] = result
        else:
            self.temp(rcpt, "refused_temp", _RANK_REFUSED, _as_client_reply(result))

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes.values() if o == outcome)




class DedupCore:
    """Decides, per envelope recipient, whether a message goes upstream, and what to answer."""

    def __init__(
        self,
        *,
        store: FingerprintStore,
        upstream: Upstream,
        metrics: Metrics,
        policy: Policy,
        notifier: Notifier | None = None,
    ) -> None:
        self._store = store
        self._upstream = upstream
        self._metrics = metrics
        self._policy = policy
        self._notifier = notifier  # RFC 3464 notices for refusals after a 250
        self._settler = Settler(store=store, metrics=metrics, window_s=policy.window_s,
                                lease_s=policy.lease_s)

    @property
    def background(self) -> set[asyncio.Task[None]]:
        """Settlements still being retried after their message was answered."""
        return self._settler.background

    def owed_settles(self) -> list[tuple[str, SettleOp]]:
        """Settles not landed yet, as ``(token, op)`` (for the settle journal at shutdown)."""
        return self._settler.owed()

    async def pay_owed(self, owed: Sequence[tuple[str, SettleOp]]) -> list[tuple[str, SettleOp]]:
        """Apply settles an earlier run owed; returns those that did not land yet (they are
        retried in the background). Never raises."""
        return await self._settler.pay(owed)

    async def process(self, msg: InboundMessage) -> Decision:
        """Handle one message end to end and return the reply for the final dot.

        Never raises for store or upstream failures: they become 4yz replies (design.md
        §1: nothing answered 250 is lost, nothing is sent twice by a retry).
        """
        p = self._policy
        try:
            headers = extract_dedup_headers(
                msg.content,
                key_names=p.key_names,
                template_names=p.template_names,
                max_key_chars=p.max_key_chars,
            )
        except InvalidDedupKeyError as exc:
            return self._finish(msg, replies.invalid_key(str(exc)), "invalid", {})
        if headers.key is None:
            if p.missing_key == "reject":
                return self._finish(msg, replies.MISSING_KEY_REJECTED, "invalid", {})
            return await self._relay_plain(msg, relayed_outcome="no_key")
        try:
            scope = msg.auth_user if p.scope_by_auth else None
            keys = self._keys(msg.rcpt_tos, headers.template, headers.key, scope)
        except InvalidAddressError:
            return self._finish(msg, replies.BAD_RECIPIENT_ADDRESS, "invalid", {})
        decision = await self._relay_dedup(msg, keys)
        return dataclasses.replace(decision, keys=keys)

    def _keys(self, rcpt_tos: Sequence[str], template: str, key: str,
              scope: str | None) -> dict[str, str]:
        """Map each recipient to its store key (design.md §2)."""
        p = self._policy
        out: dict[str, str] = {}
        for rcpt in rcpt_tos:
            norm = normalize_recipient(rcpt, local_part_case_sensitive=p.local_part_case_sensitive)
            fp = fingerprint(norm, template, key, secret=p.secret, scope=scope)
            out[rcpt] = store_key(p.key_prefix, fp)
        return out

    async def _relay_dedup(self, msg: InboundMessage, keys: dict[str, str]) -> Decision:
        token = secrets.token_hex(16)  # 128-bit random token per attempt (design.md §3)
        unique_keys = list(dict.fromkeys(keys.values()))
        try:
            await self._settler.flush(unique_keys)
            reservations = await self._reserve_uncut(unique_keys, token)
        except asyncio.CancelledError:  # shutdown past its grace, before anything was sent
            absorb_cancel()
            tally = self._all_temp(msg, "refused_temp", replies.CUT_BY_SHUTDOWN)
            return self._conclude(msg, tally, None)
        except StoreError as exc:
            log.error("store reserve failed (%s); policy store_down=%s",
                      exc, self._policy.store_down)
            await self._settler.release_quietly(unique_keys, token)
            if self._policy.store_down == "fail_open":
                return await self._relay_plain(msg, relayed_outcome="store_down")
            return self._conclude(msg, self._all_temp(msg, "store_down", replies.STORE_DOWN),
                                  None)
        by_key = {r.key: r for r in reservations}
        tally = _Tally()
        to_send = self._partition(keys, by_key, tally, msg.queue_id)
        if not to_send:
            return self._conclude(msg, tally, None)
        # one upstream recipient per fingerprint: the first spelling the client used
        first_rcpt: dict[str, str] = {}
        for rcpt, key in keys.items():
            if key in to_send:
                first_rcpt.setdefault(key, rcpt)
        return await self._send_reserved(msg, keys, first_rcpt, token, tally)

    async def _send_reserved(self, msg: InboundMessage, keys: Mapping[str, str],
                             first_rcpt: dict[str, str], token: str, tally: _Tally) -> Decision:
        """Relay the fingerprints this attempt reserved, keeping their lease alive while the
        upstream works, then settle them; the settle after a definite reply always completes
        (a shutdown past its grace waits for it) and the client gets that reply."""
        progress = DeliveryProgress()
        progress.before_dot = self._settler.sending_marker(first_rcpt, token, progress)
        try:
            async with self._settler.kept_alive(list(first_rcpt), token):
                result = await self._deliver(msg, list(first_rcpt.values()), progress)
        except asyncio.CancelledError:  # shutdown past its grace cut the transaction
            absorb_cancel()
            await self._settler.settle_cut(list(first_rcpt), token, progress.dot_written,
                                           time.monotonic() + self._policy.lease_s)
            return self._cut_decision(msg, keys, first_rcpt, tally, progress.dot_written)
        # the lease was renewed while the upstream worked, last at most a third of it ago
        lease_ends = time.monotonic() + self._policy.lease_s * 2 / 3
        await self._settle(result, first_rcpt, token, lease_ends)
        self._tally_delivery(result, keys, first_rcpt, tally)
        return self._conclude(msg, tally, result)

    async def _reserve_uncut(self, keys: list[str], token: str) -> list[Reservation]:
        """Reserve ``keys``; when shutdown cuts the wait, let the reserve finish, undo what of
        it landed (compare-token), then raise the cancellation: a PENDING record left behind
        would answer the client's retry with 450 until its lease ends."""
        reserving = asyncio.ensure_future(self._reserve(keys, token))
        try:
            return await asyncio.shield(reserving)
        except asyncio.CancelledError:
            absorb_cancel()
            with contextlib.suppress(StoreError):
                await run_to_end(reserving)  # a second cut must not skip the release
            await self._settler.release_quietly(keys, token)
            raise asyncio.CancelledError from None

    @staticmethod
    def _all_temp(msg: InboundMessage, outcome: str, reply: SmtpReply) -> _Tally:
        tally = _Tally()
        for rcpt in msg.rcpt_tos:
            tally.temp(rcpt, outcome, _RANK_STORE_DOWN, reply)
        return tally

    def _cut_decision(self, msg: InboundMessage, keys: Mapping[str, str],
                      first_rcpt: Mapping[str, str], tally: _Tally,
                      dot_written: bool) -> Decision:
        """The reply for a transaction shutdown cut: in doubt after the dot, else try again."""
        outcome, reply = (("unknown", replies.OUTCOME_UNKNOWN) if dot_written
                          else ("refused_temp", replies.CUT_BY_SHUTDOWN))
        for rcpt, key in keys.items():
            if key in first_rcpt:
                tally.temp(rcpt, outcome, _RANK_UNKNOWN, reply)
        return self._conclude(msg, tally, None)

    def _partition(
        self, keys: Mapping[str, str], by_key: Mapping[str, Reservation], tally: _Tally,
        queue_id: str,
    ) -> set[str]:
        """Sort recipients by what the store holds; return the keys this attempt reserved."""
        to_send: set[str] = set()
        for rcpt, key in keys.items():
            res = by_key[key]
            found = res.found
            if res.reserved:
                if key not in to_send and found is not None and found.state is State.UNKNOWN:
                    # unknown_policy = send (at least once, design.md §4.4): a possible duplicate
                    log.warning("relaying again although an earlier attempt is in doubt "
                                "(since %s): possible duplicate", _iso(found.at),
                                extra={"queue_id": queue_id, "key": key})
                    self._metrics.unknown_resent()
                to_send.add(key)
            elif found is not None and found.state is State.PENDING:
                tally.temp(rcpt, "inflight", _RANK_INFLIGHT, replies.INFLIGHT)
            elif (found is not None and found.state is State.UNKNOWN
                  and self._policy.unknown == "hold"):
                tally.temp(rcpt, "held", _RANK_HELD, replies.HELD_UNKNOWN)
            else:
                in_doubt = found is not None and found.state is State.UNKNOWN
                tally.add(rcpt, "suppressed_unknown" if in_doubt else "suppressed")
                at = found.at if found is not None else None
                if at is not None and (tally.first_sent_at is None or at < tally.first_sent_at):
                    tally.first_sent_at = at
        return to_send

    async def _deliver(self, msg: InboundMessage, rcpts: list[str],
                       progress: DeliveryProgress | None = None) -> DeliveryResult:
        content = msg.content
        if self._policy.strip_headers:  # design.md §5.2: the headers are the relay's
            content = strip_fields(content, (*self._policy.key_names,
                                             *self._policy.template_names))
        outbound = OutboundMessage(
            mail_from=msg.mail_from,
            rcpt_tos=rcpts,
            content=msg.trace + content,
            smtputf8=msg.smtputf8,
            eight_bit=msg.eight_bit,
            utf8_headers=msg.utf8_headers,
        )
        started = time.perf_counter()
        result = await self._upstream.deliver(outbound, progress)
        code = result.final_reply.code if result.final_reply is not None else next(
            (r.reply.code for r in result.recipients.values() if r.from_upstream), None)
        self._metrics.upstream_call(time.perf_counter() - started, code)
        return result

    async def _settle(self, result: DeliveryResult, first_rcpt: Mapping[str, str],
                      token: str, lease_ends: float) -> None:
        ops: list[SettleOp] = []
        for key, rcpt in first_rcpt.items():
            r = result.recipients[rcpt]
            action = {RcptStatus.ACCEPTED: Settle.SENT, RcptStatus.UNKNOWN: Settle.UNKNOWN,
                      RcptStatus.REFUSED: Settle.RELEASE}[r.status]
            ops.append(SettleOp(key=key, action=action, reply=str(r.reply)))
        await self._settler.settle(ops, token, lease_ends)

    def _tally_delivery(self, result: DeliveryResult, keys: Mapping[str, str],
                        first_rcpt: Mapping[str, str], tally: _Tally) -> None:
        """Each recipient's outcome from the upstream result of its fingerprint. A second
        spelling of one mailbox in the message (``a@x`` and ``A@X``) shares the one upstream
        copy: it is ``suppressed`` when that copy was accepted (counting it ``relayed`` too
        would say two went out), and shares the refusal otherwise."""
        for rcpt, key in keys.items():
            if key not in first_rcpt:
                continue
            shared = result.recipients[first_rcpt[key]]
            if first_rcpt[key] != rcpt and shared.status is RcptStatus.ACCEPTED:
                tally.add(rcpt, "suppressed")
            else:
                tally.record(rcpt, shared, "relayed")

    async def _relay_plain(self, msg: InboundMessage, *, relayed_outcome: str) -> Decision:
        """Relay without dedup (no key, or store down with fail_open): all recipients at once.

        Cut by shutdown: the client is told so (4yz), in doubt when the final dot was out."""
        progress = DeliveryProgress()
        try:
            result = await self._deliver(msg, list(dict.fromkeys(msg.rcpt_tos)), progress)
        except asyncio.CancelledError:
            absorb_cancel()
            reply = replies.OUTCOME_UNKNOWN if progress.dot_written else replies.CUT_BY_SHUTDOWN
            outcome = "unknown" if progress.dot_written else "refused_temp"
            return self._conclude(msg, self._all_temp(msg, outcome, reply), None)
        tally = _Tally()
        for rcpt in msg.rcpt_tos:
            tally.record(rcpt, result.recipients[rcpt], relayed_outcome)
        return self._conclude(msg, tally, result, relayed_outcome=relayed_outcome)

    def _conclude(self, msg: InboundMessage, tally: _Tally, result: DeliveryResult | None,
                  *, relayed_outcome: str = "relayed") -> Decision:
        """Aggregate per-recipient outcomes into one reply, worst first (design.md §4.3)."""
        relayed = tally.count(relayed_outcome)
        in_doubt = tally.count("suppressed_unknown")
        suppressed = tally.count("suppressed") + in_doubt
        refused_perm = tally.count("refused_perm")
        upstream_reply = result.final_reply if result is not None else None
        if tally.temp_replies:
            reply = min(tally.temp_replies, key=lambda t: t[0])[1]
            res = "tempfail"
        elif refused_perm and not relayed:
            reply, res = tally.perm_replies[0], "permfail"
        elif relayed:
            reply = replies.accepted(relayed, suppressed, refused_perm, msg.queue_id, in_doubt)
            res = "relayed" if relayed_outcome == "relayed" else relayed_outcome
        else:
            when = _iso(tally.first_sent_at)
            reply = replies.all_suppressed(suppressed, when, msg.queue_id, in_doubt)
            res = "suppressed"
        if self._notifier is not None and reply.code == 250 and tally.perm_results:
            # RFC 5321 4.2.5, 6.1: a 250 makes the relay owe notice of the refused recipients
            self._notifier.non_delivery(NonDelivery(
                mail_from=msg.mail_from, failures=dict(tally.perm_results),
                content=msg.trace + msg.content, queue_id=msg.queue_id))
        return self._finish(msg, reply, res, tally.outcomes, upstream_reply)

    def _finish(self, msg: InboundMessage, reply: SmtpReply, result: str,
                outcomes: Mapping[str, str], upstream_reply: SmtpReply | None = None) -> Decision:
        self._metrics.message(result)
        for outcome in set(outcomes.values()):
            self._metrics.recipients(outcome, sum(1 for o in outcomes.values() if o == outcome))
        return Decision(reply=reply, result=result, outcomes=dict(outcomes),
                        upstream_reply=upstream_reply)

    async def _reserve(self, keys: list[str], token: str) -> list[Reservation]:
        started = time.perf_counter()
        try:
            out = await self._store.reserve(keys, token=token, lease_s=self._policy.lease_s,
                                            resend_unknown=self._policy.unknown == "send")
        except StoreError:
            self._metrics.store_call("reserve", time.perf_counter() - started, False)
            raise
        self._metrics.store_call("reserve", time.perf_counter() - started, True)
        return out


def _as_client_reply(result: RcptResult) -> SmtpReply:
    """A refusal as our client sees it: the upstream's passed through, the relay's own as is."""
    return replies.pass_through(result.reply) if result.from_upstream else result.reply


def _iso(at: float | None) -> str | None:
    if at is None:
        return None
    return datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
