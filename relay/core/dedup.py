"""The dedup core: reserve -> classify -> send -> settle -> aggregate reply (design.md §4).

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
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from relay.core import replies, rules
from relay.core.audit import entries_for
from relay.core.cancellation import absorb_cancel, reply_past_cut, run_to_end
from relay.core.errors import InvalidAddressError, InvalidDedupKeyError, StoreError
from relay.core.headers import DedupHeaders, ParsedMessage, parse_message
from relay.core.interfaces import (
    AuditLedger,
    DeliveryProgress,
    DeliveryResult,
    FingerprintStore,
    LimitCheck,
    Metrics,
    NonDelivery,
    Notifier,
    OutboundMessage,
    Outcome,
    RateLimiter,
    RcptResult,
    Reservation,
    Result,
    SettleOp,
    SmtpReply,
    Upstream,
)
from relay.core.keys import recipient_keys
from relay.core.limits import LimitSubject, RateRule, checks_for
from relay.core.policy import Policy, TemplateRule
from relay.core.rules import Action, Verdict
from relay.core.settlement import Settler

__all__ = ["Decision", "DedupCore", "InboundMessage", "Policy", "TemplateRule"]

log = logging.getLogger("relay.core.dedup")


def _upstream_name() -> str:
    """The ``upstream`` scope's value when the relay names no upstream: one bucket."""
    return "upstream"


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
    # the content with its header section located (the listener parses it once at DATA); a
    # message made without one is parsed here, once
    parsed: ParsedMessage | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.parsed is None or self.parsed.content is not self.content:
            object.__setattr__(self, "parsed", parse_message(self.content))

    @property
    def message(self) -> ParsedMessage:
        """The content parsed (:func:`relay.core.headers.parse_message`)."""
        assert self.parsed is not None  # set by __post_init__
        return self.parsed


@dataclass(frozen=True)
class Decision:
    """What the core decided: the client ``reply``, one outcome per recipient, a ``result``,
    and each recipient's store key (``keys``; empty for a message without a dedupe key), so an
    operator can find the record of an in-doubt message from its log line."""

    reply: SmtpReply
    result: Result
    outcomes: Mapping[str, Outcome] = field(default_factory=dict)
    upstream_reply: SmtpReply | None = None
    keys: Mapping[str, str] = field(default_factory=dict)
    # what the audit ledger records beside the outcomes (design.md §6.7): the message's template and
    # dedupe key as normalized (design.md §2), the upstream transaction's result of each
    # recipient in it, and the name of the upstream that gave them
    template: str = ""
    dedupe_key: str | None = None
    rcpt_results: Mapping[str, RcptResult] = field(default_factory=dict)
    upstream: str = ""


class DedupCore:
    """Decides, per envelope recipient, whether a message goes upstream, and what to answer.

    The decisions are the rules of :mod:`relay.core.rules`; this class runs the steps around
    them (reserve, relay, settle) and reports to the metrics.
    """

    def __init__(
        self,
        *,
        store: FingerprintStore,
        upstream: Upstream,
        metrics: Metrics,
        policy: Policy,
        notifier: Notifier | None = None,
        limiter: RateLimiter | None = None,
        rate_limits: Sequence[RateRule] = (),
        upstream_name: Callable[[], str] | None = None,
        ledger: AuditLedger | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._upstream = upstream
        self._metrics = metrics
        self._policy = policy
        self._notifier = notifier  # RFC 3464 notices for refusals after a 250
        self._limiter = limiter  # the store's shared counters; None: no rate limits
        self._rate_limits = tuple(rate_limits)
        # the upstream the relay would try first now: the scope ``upstream`` of a rate limit
        self._upstream_name = upstream_name if upstream_name is not None else _upstream_name
        self._ledger = ledger  # the audit ledger (design.md §6.7): one row per recipient decision
        self._clock = clock  # the relay's wall clock, unix seconds: a ledger row's decided_at
        self._settler = Settler(store=store, metrics=metrics, window_s=policy.window_s,
                                lease_s=policy.lease_s)

    @property
    def policy(self) -> Policy:
        """The relay's dedup policy; setting it (a configuration reload) applies to the next
        message: a message being handled keeps the policy it started with."""
        return self._policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self._policy = policy

    @property
    def rate_limits(self) -> tuple[RateRule, ...]:
        """The ``[[rate_limit]]`` rules (:mod:`relay.core.limits`); setting them (a
        configuration reload) applies from the next message; the counters in the store
        stay (a rule keeps its buckets while its label stays)."""
        return self._rate_limits

    @rate_limits.setter
    def rate_limits(self, rules: Sequence[RateRule]) -> None:
        self._rate_limits = tuple(rules)

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
        §1: nothing answered 250 is lost, nothing is sent twice by a retry). With an audit
        ledger every recipient's decision is handed to it (design.md §6.7); a required ledger
        that cannot take rows makes the message ``451 4.3.0`` before anything is reserved.
        """
        ledger = self._ledger
        admitted = ledger is None or ledger.admits()
        if not admitted:
            log.warning("audit ledger unavailable and required: answering 451",
                        extra={"queue_id": msg.queue_id})
            decision = self._finish(replies.LEDGER_UNAVAILABLE, Result.TEMPFAIL,
                                    dict.fromkeys(msg.rcpt_tos, Outcome.REFUSED_TEMP))
        else:
            decision = await self._decide(msg)
        if ledger is not None:
            ledger.record(entries_for(
                now=self._clock(), rcpt_tos=msg.rcpt_tos, outcomes=decision.outcomes,
                keys=decision.keys, template=decision.template,
                dedupe_key=decision.dedupe_key, rcpt_results=decision.rcpt_results,
                final_reply=decision.upstream_reply, client_reply=decision.reply,
                upstream=decision.upstream, message_id=msg.message.message_id,
                queue_id=msg.queue_id),
                admitted=admitted)
        return decision

    async def _decide(self, msg: InboundMessage) -> Decision:
        """:meth:`process` without the ledger: the decision, with the message's template
        and dedupe key once they were read."""
        relay_policy = self._policy  # a reload swaps it: this message keeps the one it met
        try:
            headers = msg.message.dedup_headers(
                key_names=relay_policy.key_names,
                template_names=relay_policy.template_names,
                max_key_chars=relay_policy.max_key_chars,
            )
        except InvalidDedupKeyError as exc:
            return self._finish(replies.invalid_key(str(exc)), Result.INVALID, {})
        decision = await self._decide_read(msg, headers, relay_policy)
        return dataclasses.replace(decision, template=headers.template,
                                   dedupe_key=headers.key)

    async def _decide_read(self, msg: InboundMessage, headers: DedupHeaders,
                           relay_policy: Policy) -> Decision:
        """Decide for a message whose dedup header fields were read (design.md §2)."""
        p = relay_policy.for_templates(headers.templates)  # design.md §4.6
        keys: dict[str, str] | None = None
        if p.dedup and headers.key is None and p.missing_key == "reject":
            return self._finish(replies.MISSING_KEY_REJECTED, Result.INVALID, {})
        if p.dedup and headers.key is not None:
            try:
                keys = self._keys(msg.rcpt_tos, headers.template, headers.key, msg.auth_user, p)
            except InvalidAddressError:
                return self._finish(replies.BAD_RECIPIENT_ADDRESS, Result.INVALID, {})
        # rate limits: after what refuses the message anyway, before anything is reserved
        limited = await self._rate_limited(msg, headers.templates, p)
        if limited is not None:
            return limited
        if not p.dedup:  # an exempt template: relayed every time, without a reservation
            return await self._relay_plain(msg, p, relayed=Outcome.EXEMPT)
        if keys is None:
            return await self._relay_plain(msg, p, relayed=Outcome.NO_KEY)
        decision = await self._relay_dedup(msg, keys, p)
        return dataclasses.replace(decision, keys=keys)

    async def _rate_limited(self, msg: InboundMessage, templates: Sequence[str],
                            p: Policy) -> Decision | None:
        """Take this message's share of every rate limit that applies (one store round trip,
        all or nothing: :class:`relay.core.interfaces.RateLimiter`); None when it may go on.
        Over a limit: ``451 4.7.0`` (messages) or ``452 4.5.3`` (recipients) for every
        recipient, counted in ``relay_rate_limited_total{limit}``. The store down: as for the
        reserve (``store_down``: fail_closed answers ``451 4.3.0``; fail_open lets it go on)."""
        limits = self._rate_limits
        if not limits or self._limiter is None:
            return None
        subject = LimitSubject(upstream=self._upstream_name(), auth_user=msg.auth_user,
                               mail_from=msg.mail_from, templates=templates,
                               recipients=len(set(msg.rcpt_tos)))
        checks = checks_for(limits, subject)
        if not checks:
            return None
        started = time.perf_counter()
        try:
            verdict = await self._limiter.acquire(checks)
        except asyncio.CancelledError:  # shutdown past its grace: nothing was sent
            absorb_cancel()
            return self._conclude(msg, self._for_all(msg, rules.after_cut(False).verdict), None,
                                  p=p)
        except StoreError as exc:
            self._metrics.store_call("rate_limit", time.perf_counter() - started, False)
            log.error("rate limit check failed (%s); policy store_down=%s", exc, p.store_down,
                      extra={"queue_id": msg.queue_id})
            failed = rules.reserve_failed(p.store_down)
            if failed.verdict is None:  # fail_open: not limited while the store is down
                return None
            return self._conclude(msg, self._for_all(msg, failed.verdict), None, p=p)
        self._metrics.store_call("rate_limit", time.perf_counter() - started, True)
        if verdict.allowed or verdict.refused is None:
            return None
        return self._over_limit(msg, verdict.refused, verdict.retry_after_s)

    def _over_limit(self, msg: InboundMessage, check: LimitCheck,
                    retry_after_s: float | None) -> Decision:
        """The reply for a message refused by ``check``; nothing was reserved or relayed."""
        if check.kind == "recipients":
            reply = replies.rate_limited_recipients(check.label, retry_after_s, check.cost,
                                                    check.limit, check.per_s)
        else:
            reply = replies.rate_limited(check.label, retry_after_s or 0.0)
        log.info("rate limit %s reached (%s): answered %s", check.label, check.kind, reply.code,
                 extra={"queue_id": msg.queue_id})
        self._metrics.rate_limited(check.label)
        return self._finish(reply, Result.TEMPFAIL, dict.fromkeys(msg.rcpt_tos,
                                                                  Outcome.REFUSED_TEMP))

    @staticmethod
    def _keys(rcpt_tos: Sequence[str], template: str, key: str, auth_user: str | None,
              policy: Policy) -> dict[str, str]:
        """Map each recipient to its store key (:func:`relay.core.keys.recipient_keys`, the
        derivation the admin commands use too); raises InvalidAddressError."""
        return recipient_keys(rcpt_tos, template, key, policy, auth_user)

    async def _relay_dedup(self, msg: InboundMessage, keys: dict[str, str],
                           p: Policy) -> Decision:
        token = secrets.token_hex(16)  # 128-bit random token per attempt (design.md §3)
        unique_keys = list(dict.fromkeys(keys.values()))
        try:
            await self._settler.flush(unique_keys)
            reservations = await self._reserve_uncut(unique_keys, token, p)
        except asyncio.CancelledError:  # shutdown past its grace, before anything was sent
            absorb_cancel()
            return self._conclude(msg, self._for_all(msg, rules.after_cut(False).verdict), None,
                                  p=p)
        except StoreError as exc:
            log.error("store reserve failed (%s); policy store_down=%s", exc, p.store_down)
            await self._settler.release_quietly(unique_keys, token)
            failed = rules.reserve_failed(p.store_down)
            if failed.verdict is None:  # fail_open
                return await self._relay_plain(msg, p, relayed=Outcome.STORE_DOWN)
            return self._conclude(msg, self._for_all(msg, failed.verdict), None, p=p)
        by_key = {r.key: r for r in reservations}
        verdicts: dict[str, Verdict] = {}
        to_send = self._partition(keys, by_key, verdicts, msg.queue_id, p)
        # one upstream recipient per fingerprint: the first spelling the client used
        first_rcpt: dict[str, str] = {}
        for rcpt, key in keys.items():
            if key in to_send:
                first_rcpt.setdefault(key, rcpt)
        shadow = self._shadowed(keys, verdicts, msg.queue_id) if p.mode == "shadow" else {}
        if not first_rcpt and not shadow:
            return self._conclude(msg, verdicts, None, p=p)
        return await self._send_reserved(msg, keys, first_rcpt, token, verdicts, p, shadow)

    @staticmethod
    def _shadowed(keys: Mapping[str, str], verdicts: dict[str, Verdict],
                  queue_id: str) -> dict[str, str]:
        """Shadow mode (design.md §4.6): take out of ``verdicts`` every recipient that enforce
        would keep back (:data:`relay.core.rules.SHADOWED`: a duplicate, in doubt) and return them
        as store key -> the first spelling to relay anyway; nothing is reserved for them."""
        shadow: dict[str, str] = {}
        for rcpt, key in keys.items():
            verdict = verdicts.get(rcpt)
            if verdict is None or verdict.outcome not in rules.SHADOWED:
                continue
            del verdicts[rcpt]
            if key not in shadow:
                shadow[key] = rcpt
                log.info("shadow mode: would have answered %s without relaying; relaying",
                         verdict.outcome.value, extra={"queue_id": queue_id, "key": key})
        return shadow

    async def _send_reserved(self, msg: InboundMessage, keys: Mapping[str, str],
                             first_rcpt: dict[str, str], token: str,
                             verdicts: dict[str, Verdict], p: Policy,
                             shadow: Mapping[str, str]) -> Decision:
        """Relay the fingerprints this attempt reserved (``first_rcpt``: key -> recipient) and,
        in shadow mode, the copies enforce would keep back (``shadow``, not reserved), keeping
        the reservations' lease alive while the upstream works, then settle them; the settle
        after a definite reply always completes (a shutdown past its grace waits for it) and
        the client gets that reply."""
        progress = DeliveryProgress()
        progress.before_dot = self._settler.sending_marker(first_rcpt, token, progress,
                                                           p.window_s)
        sent_for = {**first_rcpt, **shadow}  # store key -> the recipient relayed for it

        async def kept_alive_delivery() -> DeliveryResult:
            async with self._settler.kept_alive(list(first_rcpt), token, p.window_s):
                return await self._deliver(msg, list(sent_for.values()), progress, p)

        # a shutdown past its grace cuts the transaction, unless its dot is out and the reply
        # comes within AFTER_DOT_WAIT_S (then it is settled by that reply, as any other)
        result = await reply_past_cut(asyncio.ensure_future(kept_alive_delivery()),
                                      lambda: progress.dot_written)
        if result is None:
            cut = rules.after_cut(progress.dot_written)
            if first_rcpt:
                await self._settler.settle_cut(list(first_rcpt), token, progress.dot_written,
                                               time.monotonic() + p.lease_s, p.window_s)
            for rcpt, key in keys.items():
                if key in sent_for:
                    verdicts[rcpt] = cut.verdict
            return self._conclude(msg, verdicts, None, p=p)
        # the lease was renewed while the upstream worked, last at most a third of it ago
        lease_ends = time.monotonic() + p.lease_s * 2 / 3
        ops = [SettleOp(key=key, action=rules.after_upstream(result.recipients[rcpt]).settle,
                        reply=str(result.recipients[rcpt].reply), window_s=p.window_s)
               for key, rcpt in first_rcpt.items()]
        if ops:
            await self._settler.settle(ops, token, lease_ends)
        for rcpt, key in keys.items():
            if key in sent_for:  # a second spelling of a mailbox shares its one copy
                first = sent_for[key]
                verdicts[rcpt] = rules.after_upstream(
                    result.recipients[first], second_spelling=first != rcpt,
                    relayed=Outcome.RELAYED if key in first_rcpt else Outcome.WOULD_SUPPRESS,
                ).verdict
        return self._conclude(msg, verdicts, result, p=p)

    async def _reserve_uncut(self, keys: list[str], token: str,
                             p: Policy) -> list[Reservation]:
        """Reserve ``keys``; when shutdown cuts the wait, let the reserve finish, undo what of
        it landed (compare-token), then raise the cancellation: a PENDING record left behind
        would answer the client's retry with 450 until its lease ends."""
        reserving = asyncio.ensure_future(self._reserve(keys, token, p))
        try:
            return await asyncio.shield(reserving)
        except asyncio.CancelledError:
            absorb_cancel()
            with contextlib.suppress(StoreError):
                await run_to_end(reserving)  # a second cut must not skip the release
            await self._settler.release_quietly(keys, token)
            raise asyncio.CancelledError from None

    @staticmethod
    def _for_all(msg: InboundMessage, verdict: Verdict) -> dict[str, Verdict]:
        return dict.fromkeys(msg.rcpt_tos, verdict)

    def _partition(
        self, keys: Mapping[str, str], by_key: Mapping[str, Reservation],
        verdicts: dict[str, Verdict], queue_id: str, p: Policy,
    ) -> set[str]:
        """Classify each recipient by what the store held (:func:`relay.core.rules.classify`):
        the verdict of those answered without sending goes into ``verdicts``; returns the keys
        this attempt reserved, to send."""
        to_send: set[str] = set()
        for rcpt, key in keys.items():
            found = by_key[key].found
            decided = rules.classify(by_key[key], unknown_policy=p.unknown, lease_s=p.lease_s)
            if decided.action is Action.RESEND_IN_DOUBT and key not in to_send:
                # unknown_policy = send (at least once, design.md §4.4): a possible duplicate
                log.warning("relaying again although an earlier attempt is in doubt "
                            "(since %s): possible duplicate",
                            rules.iso_utc(found.at if found is not None else None),
                            extra={"queue_id": queue_id, "key": key})
                self._metrics.unknown_resent()
            if decided.verdict is None:
                to_send.add(key)
            else:
                verdicts[rcpt] = decided.verdict
        return to_send

    async def _deliver(self, msg: InboundMessage, rcpts: list[str],
                       progress: DeliveryProgress | None, p: Policy) -> DeliveryResult:
        content = msg.content
        if p.strip_headers:  # design.md §5.2: the headers are the relay's
            content = msg.message.without((*p.key_names, *p.template_names))
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
        self._metrics.upstream_call(time.perf_counter() - started, code, result.upstream)
        return result

    async def _relay_plain(self, msg: InboundMessage, p: Policy, *,
                           relayed: Outcome) -> Decision:
        """Relay without dedup (no key, or store down with fail_open): all recipients at once;
        an accepted recipient's outcome is ``relayed`` (``no_key`` or ``store_down``).

        Cut by shutdown: the client is told so (4yz), in doubt when the final dot was out."""
        progress = DeliveryProgress()
        result = await reply_past_cut(asyncio.ensure_future(
            self._deliver(msg, list(dict.fromkeys(msg.rcpt_tos)), progress, p)),
            lambda: progress.dot_written)
        if result is None:  # cut by shutdown
            cut = rules.after_cut(progress.dot_written).verdict
            return self._conclude(msg, self._for_all(msg, cut), None)
        verdicts = {rcpt: rules.after_upstream(result.recipients[rcpt], relayed=relayed).verdict
                    for rcpt in msg.rcpt_tos}
        return self._conclude(msg, verdicts, result, relayed=relayed)

    def _conclude(self, msg: InboundMessage, verdicts: Mapping[str, Verdict],
                  result: DeliveryResult | None, *, relayed: Outcome = Outcome.RELAYED,
                  p: Policy | None = None) -> Decision:
        """Fold the recipients' verdicts into one reply (:func:`relay.core.rules.aggregate`,
        with the message policy ``p``'s duplicate reply), and owe the sender a notice of
        permanent refusals the client is answered 250 for."""
        reply, res = rules.aggregate(
            verdicts.values(), queue_id=msg.queue_id, relayed=relayed,
            duplicate_reply=p.duplicate_reply if p is not None else "250")
        failures = {rcpt: v.refusal for rcpt, v in verdicts.items() if v.refusal is not None}
        if self._notifier is not None and reply.code == 250 and failures:
            # RFC 5321 4.2.5, 6.1: a 250 makes the relay owe notice of the refused recipients
            self._notifier.non_delivery(NonDelivery(
                mail_from=msg.mail_from, failures=failures,
                content=msg.trace + msg.content, queue_id=msg.queue_id,
                header_end=len(msg.trace) + msg.message.header_end))
        upstream_reply = result.final_reply if result is not None else None
        decision = self._finish(reply, res, {rcpt: v.outcome for rcpt, v in verdicts.items()},
                                upstream_reply)
        if result is None:
            return decision
        return dataclasses.replace(decision, rcpt_results=result.recipients,
                                   upstream=result.upstream)

    def _finish(self, reply: SmtpReply, result: Result, outcomes: Mapping[str, Outcome],
                upstream_reply: SmtpReply | None = None) -> Decision:
        self._metrics.message(result)
        for outcome, count in Counter(outcomes.values()).items():
            self._metrics.recipients(outcome, count)
        return Decision(reply=reply, result=result, outcomes=dict(outcomes),
                        upstream_reply=upstream_reply)

    async def _reserve(self, keys: list[str], token: str, p: Policy) -> list[Reservation]:
        started = time.perf_counter()
        try:
            out = await self._store.reserve(keys, token=token, lease_s=p.lease_s,
                                            resend_unknown=p.unknown == "send")
        except StoreError:
            self._metrics.store_call("reserve", time.perf_counter() - started, False)
            raise
        self._metrics.store_call("reserve", time.perf_counter() - started, True)
        return out
