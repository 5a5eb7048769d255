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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from relay.core import replies, rotation, rules
from relay.core.cancellation import absorb_cancel, reply_past_cut, run_to_end
from relay.core.errors import InvalidAddressError, InvalidDedupKeyError, StoreError
from relay.core.gates import Gates
from relay.core.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    FingerprintStore,
    LimitCheck,
    Metrics,
    OutboundMessage,
    Outcome,
    RcptResult,
    Reservation,
    Result,
    SettleOp,
    SmtpReply,
    Upstream,
)
from relay.core.keys import DerivedKey, RecipientKey, derive_key, recipient_key
from relay.core.limits import RateRule
from relay.core.message import Decision, DecisionObserver, InboundMessage
from relay.core.observers import CountDecisions
from relay.core.policy import Policy, TemplateRule
from relay.core.rules import Action, Verdict
from relay.core.settlement import Settler
from relay.core.waiting import InFlightWaits

__all__ = ["Decision", "DedupCore", "InboundMessage", "Policy", "TemplateRule"]

log = logging.getLogger("relay.core.dedup")


@dataclass
class _Plan:
    """One message's plan (design.md §4): each recipient's store key (``keys``, recipient ->
    key) and, while a previous fingerprint secret is set, each key's key under it
    (``previous``, design.md §2.3), the message's stored content digest (``content``,
    design.md §2.2), what the reserve found per key (``reservations``), the keys this attempt
    reserved and sends (``send``: key -> the first spelling relayed for it), those shadow mode
    relays unreserved (``shadow``), the keys whose record was of other content (``reused``,
    §4.9), each recipient's verdict once it has one (``verdicts``), and when the reserved keys
    were marked SENDING before the final dot (``sending_at``)."""

    keys: dict[str, str] = field(default_factory=dict)
    previous: dict[str, str] = field(default_factory=dict)
    content: str = ""
    reservations: dict[str, Reservation] = field(default_factory=dict)
    send: dict[str, str] = field(default_factory=dict)
    shadow: dict[str, str] = field(default_factory=dict)
    reused: set[str] = field(default_factory=set)
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    sending_at: float | None = None  # when its records were marked SENDING (the relay's clock)


@dataclass(frozen=True)
class _Concluded:
    """What one path through the core concluded, before the message's Decision is built."""

    reply: SmtpReply
    result: Result
    outcomes: dict[str, Outcome]
    refusals: dict[str, RcptResult] = field(default_factory=dict)
    delivery: DeliveryResult | None = None
    verdicts: dict[str, Verdict] = field(default_factory=dict)  # per recipient, once ruled


class DedupCore:
    """Decides, per envelope recipient, whether a message goes upstream, and what to answer.

    The decisions are the rules of :mod:`relay.core.rules`; this class runs the steps around
    them (reserve, relay, settle) on one :class:`_Plan` per message, builds the
    :class:`Decision` in one place (:meth:`decide`) and hands it to its observers (the
    metrics, the notices owed, the audit ledger: :mod:`relay.core.observers`).

    Its ports come as the composition root built them: the spans and the timing of a store
    or upstream call are wrappers around them (:mod:`relay.ops.measured`,
    :mod:`relay.ops.traced`), never this class's work. ``settler`` settles the reservations
    (default: one over ``store`` keeping what is owed in memory only); ``gates`` is what may
    refuse a message before anything is reserved (:mod:`relay.core.gates`); ``clock`` is the
    relay's wall clock in unix seconds (a decision's ``decided_at``).
    """

    def __init__(
        self,
        *,
        store: FingerprintStore,
        upstream: Upstream,
        metrics: Metrics,
        policy: Policy,
        gates: Gates | None = None,
        observers: Sequence[DecisionObserver] = (),
        clock: Callable[[], float] = time.time,
        settler: Settler | None = None,
    ) -> None:
        self._store = store
        self._upstream = upstream
        self._metrics = metrics
        self._policy = policy
        self._gates = gates if gates is not None else Gates()
        # who sees every decision: the counters first, then the notices owed and the ledger's
        # rows (relay.core.observers)
        self._observers = (CountDecisions(metrics), *observers)
        self._clock = clock
        self._settler = settler if settler is not None else Settler(
            store=store, metrics=metrics, window_s=policy.window_s, lease_s=policy.lease_s)
        self._waits = InFlightWaits(store)  # copies waiting for another attempt (§4.8)

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
        """The ``[[rate_limit]]`` rules (:attr:`relay.core.gates.RateLimits.rules`; none
        without the store's counters); setting them (a configuration reload) applies from the
        next message."""
        limits = self._gates.rate_limits
        return limits.rules if limits is not None else ()

    @rate_limits.setter
    def rate_limits(self, rules: Sequence[RateRule]) -> None:
        if self._gates.rate_limits is not None:
            self._gates.rate_limits.rules = rules

    @property
    def background(self) -> set[asyncio.Task[None]]:
        """Settlements still being retried after their message was answered."""
        return self._settler.background

    def stop_waiting(self) -> None:
        """The relay is stopping: every copy waiting for another attempt's settle is answered
        now from what the store holds (450 while still in flight), and none waits from now."""
        self._waits.stop()

    def owed_settles(self) -> list[tuple[str, SettleOp]]:
        """Settles not landed yet, as ``(token, op)`` (for the settle journal at shutdown)."""
        return self._settler.owed()

    async def pay_owed(self, owed: Sequence[tuple[str, SettleOp]]) -> list[tuple[str, SettleOp]]:
        """Apply settles an earlier run owed; returns those that did not land yet (they are
        retried in the background). Never raises."""
        return await self._settler.pay(owed)

    async def process(self, msg: InboundMessage) -> Decision:
        """Handle one message end to end and return the reply for the final dot: the
        :meth:`decide` of ``msg``, handed to every observer (:meth:`observed`)."""
        return self.observed(msg, await self.decide(msg))

    def observed(self, msg: InboundMessage, decision: Decision) -> Decision:
        """Hand ``decision`` on ``msg`` to every observer, once; returns it."""
        for observer in self._observers:
            observer.decided(msg, decision)
        return decision

    async def decide(self, msg: InboundMessage) -> Decision:
        """The decision on ``msg``, built here, once (no observer sees it yet).

        Never raises for store or upstream failures: they become 4yz replies (design.md
        §1: nothing answered 250 is lost, nothing is sent twice by a retry). A gate that does
        not admit the message (a required ledger that cannot take rows, design.md §6.7) makes
        it ``451 4.3.0`` before anything is reserved.
        """
        received_at = self._clock()
        admitted = self._gates.admit()
        plan = _Plan()
        derived: DerivedKey | None = None
        if not admitted:
            log.warning("audit ledger unavailable and required: answering 451",
                        extra={"queue_id": msg.queue_id})
            concluded = self._answer(replies.LEDGER_UNAVAILABLE, Result.TEMPFAIL,
                                     dict.fromkeys(msg.rcpt_tos, Outcome.REFUSED_TEMP))
        else:
            derived, concluded = await self._decide_key(msg, plan)
        headers = derived.headers if derived is not None else None
        delivery = concluded.delivery
        return Decision(
            reply=concluded.reply, result=concluded.result, outcomes=concluded.outcomes,
            upstream_reply=delivery.final_reply if delivery is not None else None,
            keys=plan.keys, template=headers.template if headers is not None else "",
            dedupe_key=headers.key if headers is not None else None,
            rcpt_results=delivery.recipients if delivery is not None else {},
            upstream=delivery.upstream if delivery is not None else "",
            refusals=concluded.refusals, decided_at=self._clock(), admitted=admitted,
            key_source=derived.source if derived is not None else "",
            reused=frozenset(r for r, v in concluded.verdicts.items() if v.reused),
            received_at=received_at, sending_at=plan.sending_at)

    async def _decide_key(self, msg: InboundMessage, plan: _Plan
                          ) -> tuple[DerivedKey | None, _Concluded]:
        """What the message's key (its header's, or a key rule's; None when its dedup fields
        are invalid) leads to."""
        relay_policy = self._policy  # a reload swaps it: this message keeps the one it met
        try:
            headers = msg.message.dedup_headers(
                key_names=relay_policy.key_names,
                template_names=relay_policy.template_names,
                max_key_chars=relay_policy.max_key_chars,
            )
        except InvalidDedupKeyError as exc:
            return None, self._answer(replies.invalid_key(str(exc)), Result.INVALID, {})
        derived = derive_key(msg.message, headers, relay_policy, mail_from=msg.mail_from,
                             rcpt_tos=msg.rcpt_tos)
        if derived.rule is not None and derived.missed:  # relayed without dedup, counted
            log.info("key rule %s matched but derived no key: relaying without dedup",
                     derived.rule.name, extra={"queue_id": msg.queue_id})
            self._metrics.key_rule_miss(derived.rule.name)
        return derived, await self._decide_read(msg, derived, relay_policy, plan)

    async def _decide_read(self, msg: InboundMessage, derived: DerivedKey,
                           relay_policy: Policy, plan: _Plan) -> _Concluded:
        """Decide for a message whose key was derived (design.md §2)."""
        headers = derived.headers
        p = relay_policy.for_templates(headers.templates)  # design.md §4.6
        if derived.shadow:  # a key rule in shadow mode: decide and count, deliver anyway
            p = dataclasses.replace(p, mode="shadow")
        keys: dict[str, RecipientKey] | None = None
        if (p.dedup and headers.key is None and p.missing_key == "reject"
                and not derived.missed):
            return self._answer(replies.MISSING_KEY_REJECTED, Result.INVALID, {})
        if p.dedup and headers.key is not None:
            try:
                keys = {rcpt: recipient_key(rcpt, headers.template, headers.key, p,
                                            msg.auth_user) for rcpt in msg.rcpt_tos}
            except InvalidAddressError:
                return self._answer(replies.BAD_RECIPIENT_ADDRESS, Result.INVALID, {})
        # rate limits: after what refuses the message anyway, before anything is reserved
        limited = await self._rate_limited(msg, headers.templates, p)
        if limited is not None:
            return limited
        if not p.dedup:  # an exempt template: relayed every time, without a reservation
            return await self._relay_plain(msg, p, relayed=Outcome.EXEMPT)
        if keys is None:
            return await self._relay_plain(msg, p, relayed=Outcome.NO_KEY)
        plan.keys = {rcpt: found.key for rcpt, found in keys.items()}
        plan.previous = {found.key: found.previous for found in keys.values()
                         if found.previous is not None}
        plan.content = derived.content_digest()  # only for a message that is reserved
        return await self._relay_dedup(msg, plan, p)

    async def _rate_limited(self, msg: InboundMessage, templates: Sequence[str],
                            p: Policy) -> _Concluded | None:
        """Take this message's share of every rate limit that applies (one store round trip,
        all or nothing: :class:`relay.core.interfaces.RateLimiter`); None when it may go on.
        Over a limit: ``451 4.7.0`` (messages) or ``452 4.5.3`` (recipients) for every
        recipient, nothing reserved. A store that fails the check is treated as for a
        reserve (``store_down``: fail_closed answers ``451 4.3.0``; fail_open lets it go on)."""
        limits = self._gates.rate_limits
        if limits is None:
            return None
        try:
            verdict = await limits.acquire(msg, templates)
        except asyncio.CancelledError:  # shutdown past its grace: nothing was sent
            absorb_cancel()
            return self._conclude(msg, self._for_all(msg, rules.after_cut(False).verdict), None,
                                  p=p)
        except StoreError as exc:
            log.error("rate limit check failed (%s); policy store_down=%s", exc, p.store_down,
                      extra={"queue_id": msg.queue_id})
            failed = rules.reserve_failed(p.store_down)
            if failed.verdict is None:  # fail_open: not limited while the store is down
                return None
            return self._conclude(msg, self._for_all(msg, failed.verdict), None, p=p)
        if verdict is None or verdict.allowed or verdict.refused is None:
            return None
        return self._over_limit(msg, verdict.refused, verdict.retry_after_s)

    def _over_limit(self, msg: InboundMessage, check: LimitCheck,
                    retry_after_s: float | None) -> _Concluded:
        """The reply for a message refused by ``check``; nothing was reserved or relayed."""
        if check.kind == "recipients":
            reply = replies.rate_limited_recipients(check.label, retry_after_s, check.cost,
                                                    check.limit, check.per_s)
        else:
            reply = replies.rate_limited(check.label, retry_after_s or 0.0)
        log.info("rate limit %s reached (%s): answered %s", check.label, check.kind, reply.code,
                 extra={"queue_id": msg.queue_id})
        self._metrics.rate_limited(check.label)
        return self._answer(reply, Result.TEMPFAIL, dict.fromkeys(msg.rcpt_tos,
                                                                  Outcome.REFUSED_TEMP))

    async def _relay_dedup(self, msg: InboundMessage, plan: _Plan, p: Policy) -> _Concluded:
        """Reserve every key of ``plan``, classify each recipient by what its reserve found,
        relay what this attempt reserved (and in shadow mode the copies enforce keeps back),
        settle, conclude."""
        token = secrets.token_hex(16)  # 128-bit random token per attempt (design.md §3)
        unique_keys = list(dict.fromkeys(plan.keys.values()))
        reserving = False
        try:
            await self._settler.flush(unique_keys)  # what is owed on the keys lands first
            reserving = True
            reservations = await self._reserve_uncut(unique_keys, token, p, plan)
        except asyncio.CancelledError:  # shutdown past its grace, before anything was sent
            absorb_cancel()
            return self._conclude(msg, self._for_all(msg, rules.after_cut(False).verdict), None,
                                  p=p)
        except StoreError as exc:
            log.error("store %s failed (%s); policy store_down=%s",
                      "reserve" if reserving else "settle owed on a key", exc, p.store_down)
            if reserving:
                await self._settler.release_quietly(unique_keys, token)
            failed = rules.reserve_failed(p.store_down)
            if failed.verdict is None:  # fail_open
                return await self._relay_plain(msg, p, relayed=Outcome.STORE_DOWN)
            return self._conclude(msg, self._for_all(msg, failed.verdict), None, p=p)
        plan.reservations = {r.key: r for r in reservations}
        self._classify(plan, msg.queue_id, p)
        if p.mode == "shadow":
            self._shadow(plan, msg.queue_id)
        held = self._held_elsewhere(plan) if p.in_flight_wait_s > 0 else {}
        if held:
            return await self._send_and_wait(msg, plan, token, p, held)
        if not plan.send and not plan.shadow:
            return self._conclude(msg, plan.verdicts, None, p=p)
        return await self._send_reserved(msg, plan, token, p)

    def _classify(self, plan: _Plan, queue_id: str, p: Policy) -> None:
        """Classify each recipient by what the store held (:func:`relay.core.rules.classify`):
        the verdict of those answered without sending goes into ``plan.verdicts``; the keys
        this attempt reserved go into ``plan.send`` with their first spelling (one upstream
        recipient per fingerprint); a key whose record was of other content goes into
        ``plan.reused``, logged once (WARNING)."""
        for rcpt, key in plan.keys.items():
            reservation = plan.reservations[key]
            decided = rules.classify(reservation, unknown_policy=p.unknown, lease_s=p.lease_s,
                                     content_digest=plan.content, key_reuse=p.key_reuse)
            if decided.action is Action.RELAY_REUSED or (
                    decided.verdict is not None and decided.verdict.reused):
                self._reused(plan, key, reservation, queue_id, p)
            if decided.action is Action.RESEND_IN_DOUBT and key not in plan.send:
                # unknown_policy = send (at least once, design.md §4.4): a possible duplicate
                found = reservation.found
                log.warning("relaying again although an earlier attempt is in doubt "
                            "(since %s): possible duplicate",
                            rules.iso_utc(found.at if found is not None else None),
                            extra={"queue_id": queue_id, "key": key})
                self._metrics.unknown_resent()
            if decided.verdict is None:
                plan.send.setdefault(key, rcpt)
            else:
                plan.verdicts[rcpt] = decided.verdict

    @staticmethod
    def _reused(plan: _Plan, key: str, reservation: Reservation, queue_id: str,
                p: Policy) -> None:
        """Note that ``key``'s record was written for other content (design.md §4.9) and log
        it once per key: the application reused a key (a bug, or a key too coarse)."""
        if key in plan.reused:
            return
        plan.reused.add(key)
        found = reservation.found
        log.warning("dedupe key reused for other content: the key's record (%s %s) is of "
                    "another message; key_reuse=%s", found.state.value if found else "absent",
                    rules.iso_utc(found.at if found is not None else None), p.key_reuse,
                    extra={"queue_id": queue_id, "key": key})

    @staticmethod
    def _held_elsewhere(plan: _Plan) -> dict[str, str]:
        """The recipients (recipient -> key) whose key another attempt holds in flight."""
        return {rcpt: key for rcpt, key in plan.keys.items()
                if (v := plan.verdicts.get(rcpt)) is not None and v.outcome is Outcome.INFLIGHT}

    async def _send_and_wait(self, msg: InboundMessage, plan: _Plan, token: str, p: Policy,
                             held: dict[str, str]) -> _Concluded:
        """Relay what this attempt reserved while the recipients of ``held`` wait for the
        attempt holding their keys to settle (at most ``in_flight_wait``, design.md §4.8),
        then reserve those keys again and answer them from what the store holds: a
        duplicate once sent, relayed now once released, ``unknown_policy`` once in doubt,
        450 while still in flight. A store failure on that reserve is answered 451 whatever
        ``store_down`` says: the attempt waited for may have sent the message."""
        deadline = time.monotonic() + p.in_flight_wait_s
        watched = [plan.reservations[key].under or key for key in held.values()]
        waiting = asyncio.ensure_future(self._waits.until_settled(
            list(dict.fromkeys(watched)), lease_s=p.lease_s, bound_s=p.in_flight_wait_s))
        first = await self._send_reserved(msg, plan, token, p) \
            if plan.send or plan.shadow else None
        delivery = first.delivery if first is not None else None
        try:
            settled = await asyncio.shield(waiting)
        except asyncio.CancelledError:  # shutdown past its grace: answered 450 as they are
            absorb_cancel()
            waiting.cancel()
            return self._conclude(msg, plan.verdicts, delivery, p=p)
        # a key another copy took over meanwhile is waited for again, within what is left
        left_s = max(0.0, deadline - time.monotonic()) if settled else 0.0
        again = await self._relay_dedup(
            dataclasses.replace(msg, rcpt_tos=list(held)),
            _Plan(keys=dict(held), previous=plan.previous, content=plan.content),
            dataclasses.replace(p, in_flight_wait_s=left_s, store_down="fail_closed"))
        verdicts = {**plan.verdicts, **again.verdicts}
        return self._conclude(msg, {rcpt: verdicts[rcpt] for rcpt in plan.keys},
                              _merged(delivery, again.delivery), p=p)

    @staticmethod
    def _shadow(plan: _Plan, queue_id: str) -> None:
        """Shadow mode (design.md §4.6): take out of ``plan.verdicts`` every recipient that
        enforce would keep back (:data:`relay.core.rules.SHADOWED`: a duplicate, in doubt) and
        put its key into ``plan.shadow`` with the first spelling to relay anyway; nothing is
        reserved for them."""
        for rcpt, key in plan.keys.items():
            verdict = plan.verdicts.get(rcpt)
            if verdict is None or not rules.shadowed(verdict):
                continue
            del plan.verdicts[rcpt]
            if key not in plan.shadow:
                plan.shadow[key] = rcpt
                log.info("shadow mode: would have answered %s without relaying; relaying",
                         verdict.outcome.value, extra={"queue_id": queue_id, "key": key})

    async def _send_reserved(self, msg: InboundMessage, plan: _Plan, token: str,
                             p: Policy) -> _Concluded:
        """Relay the fingerprints this attempt reserved (``plan.send``) and, in shadow mode,
        the copies enforce would keep back (``plan.shadow``, not reserved), keeping the
        reservations' lease alive while the upstream works, then settle them; the settle after
        a definite reply always completes (a shutdown past its grace waits for it) and the
        client gets that reply. Each recipient's upstream result is ruled once
        (:func:`relay.core.rules.after_upstream`): its verdict, and for a reserved key's first
        spelling the settle."""
        progress = DeliveryProgress()
        progress.before_dot = self._timed(plan, self._settler.sending_marker(
            plan.send, token, progress, p.window_s))
        sent_for = {**plan.send, **plan.shadow}  # store key -> the recipient relayed for it

        async def kept_alive_delivery() -> DeliveryResult:
            async with self._settler.kept_alive(list(plan.send), token, p.window_s):
                return await self._deliver(msg, list(sent_for.values()), progress, p)

        # a shutdown past its grace cuts the transaction, unless its dot is out and the reply
        # comes within AFTER_DOT_WAIT_S (then it is settled by that reply, as any other)
        result = await reply_past_cut(asyncio.ensure_future(kept_alive_delivery()),
                                      lambda: progress.dot_written)
        if result is None:
            cut = rules.after_cut(progress.dot_written)
            if plan.send:
                await self._settler.settle_cut(list(plan.send), token, progress.dot_written,
                                               time.monotonic() + p.lease_s, p.window_s)
            for rcpt, key in plan.keys.items():
                if key in sent_for:
                    plan.verdicts[rcpt] = cut.verdict
            return self._conclude(msg, plan.verdicts, None, p=p)
        # the lease was renewed while the upstream worked, last at most a third of it ago
        lease_ends = time.monotonic() + p.lease_s * 2 / 3
        ops: list[SettleOp] = []
        for rcpt, key in plan.keys.items():
            if key not in sent_for:
                continue
            first = sent_for[key]  # a second spelling of a mailbox shares its one copy
            upstream = result.recipients[first]
            ruling = rules.after_upstream(
                upstream, second_spelling=first != rcpt,
                relayed=Outcome.RELAYED if key in plan.send else Outcome.WOULD_SUPPRESS)
            plan.verdicts[rcpt] = dataclasses.replace(ruling.verdict, reused=True) \
                if key in plan.reused else ruling.verdict
            if key in plan.send and first == rcpt:
                ops.append(SettleOp(key=key, action=ruling.settle, reply=str(upstream.reply),
                                    window_s=p.window_s))
        if ops:
            await self._settler.settle(ops, token, lease_ends)
        return self._conclude(msg, plan.verdicts, result, p=p)

    def _timed(self, plan: _Plan, marker: Callable[[Sequence[str]], Awaitable[bool]]
               ) -> Callable[[Sequence[str]], Awaitable[bool]]:
        """``marker`` (the ``before_dot`` hook) noting in ``plan.sending_at`` when it first
        said yes: the time the final dot is about to go (for the audit ledger's row)."""

        async def marked(accepted: Sequence[str]) -> bool:
            ok = await marker(accepted)
            if ok and plan.sending_at is None:
                plan.sending_at = self._clock()
            return ok

        return marked

    async def _reserve_uncut(self, keys: list[str], token: str, p: Policy,
                             plan: _Plan) -> list[Reservation]:
        """Reserve ``keys`` (:meth:`_reserve`); when shutdown cuts the wait, let the reserve
        finish, undo what of it landed (compare-token), then raise the cancellation: a
        PENDING record left behind would answer the client's retry with 450 until its lease
        ends."""
        reserving = asyncio.ensure_future(self._reserve(keys, token, p, plan))
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
        return await self._upstream.deliver(outbound, progress)

    async def _relay_plain(self, msg: InboundMessage, p: Policy, *,
                           relayed: Outcome) -> _Concluded:
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

    @staticmethod
    def _conclude(msg: InboundMessage, verdicts: Mapping[str, Verdict],
                  result: DeliveryResult | None, *, relayed: Outcome = Outcome.RELAYED,
                  p: Policy | None = None) -> _Concluded:
        """Fold the recipients' verdicts into one reply (:func:`relay.core.rules.aggregate`,
        with the message policy ``p``'s duplicate reply), keeping each permanent refusal."""
        reply, res = rules.aggregate(
            verdicts.values(), queue_id=msg.queue_id, relayed=relayed,
            duplicate_reply=p.duplicate_reply if p is not None else "250")
        return _Concluded(
            reply=reply, result=res, outcomes={r: v.outcome for r, v in verdicts.items()},
            refusals={r: v.refusal for r, v in verdicts.items() if v.refusal is not None},
            delivery=result, verdicts=dict(verdicts))

    @staticmethod
    def _answer(reply: SmtpReply, result: Result, outcomes: Mapping[str, Outcome]
                ) -> _Concluded:
        """A message answered before any recipient was ruled on."""
        return _Concluded(reply=reply, result=result, outcomes=dict(outcomes))

    async def _reserve(self, keys: list[str], token: str, p: Policy,
                       plan: _Plan) -> list[Reservation]:
        """Reserve ``keys`` with the message's content digest; while a previous secret is
        set, its records count too (:func:`relay.core.rotation.reserve`), and the keys this
        attempt took that such a record answers for are released at once."""
        claim = rotation.Claim(token=token, lease_s=p.lease_s, content_digest=plan.content,
                               resend_unknown=p.unknown == "send",
                               replace_other_content=p.key_reuse == "relay")
        reservations, release = await rotation.reserve(self._store, keys, claim,
                                                       plan.previous)
        if release:
            await self._settler.release_quietly(release, token)
        return reservations


def _merged(first: DeliveryResult | None, second: DeliveryResult | None
            ) -> DeliveryResult | None:
    """One message's two upstream transactions (its own keys, then those it waited for) as
    one result: every recipient's, the later final reply."""
    if first is None or second is None:
        return first if second is None else second
    return DeliveryResult(
        recipients={**first.recipients, **second.recipients},
        final_reply=second.final_reply or first.final_reply,
        replies=(*first.replies, *second.replies), upstream=second.upstream or first.upstream)
