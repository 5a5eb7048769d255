"""One message through the core: what the listener hands it (:class:`InboundMessage`), what
the core decides (:class:`Decision`, built in one place, :meth:`relay.core.dedup.DedupCore.
process`), and who observes the decision (:class:`DecisionObserver`: the metrics, the RFC 3464
notifier, the audit ledger; :mod:`relay.core.observers`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from relay.core.headers import ParsedMessage, parse_message
from relay.core.interfaces import Outcome, RcptResult, Result, SmtpReply


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
    operator can find the record of an in-doubt message from its log line.

    For its observers besides: the message's ``template`` and ``dedupe_key`` as normalized
    (design.md §2), the upstream transaction's result of each recipient in it
    (``rcpt_results``) and the ``upstream`` that gave them, the permanent refusals the client
    is answered for (``refusals``: a 250 with refusals owes the sender a notice, RFC 5321
    section 4.2.5), ``decided_at`` (the relay's wall clock, unix seconds) and whether the
    message was ``admitted`` (False: refused because a required ledger could not take rows).
    ``trace_id``: the message span's trace (32 hex digits; empty with tracing off), for the
    log line. ``key_source``: where the key came from (``header``, ``rule:NAME``; ``""``:
    the message had none). ``reused``: the recipients whose key held a record of other
    content (design.md §4.9). ``received_at``: the relay's wall clock when the core took the
    message (its final dot had come in); ``sending_at``: when its reservations were marked
    SENDING, right before the final dot went upstream (None: no reserved recipient was sent).
    """

    reply: SmtpReply
    result: Result
    outcomes: Mapping[str, Outcome] = field(default_factory=dict)
    upstream_reply: SmtpReply | None = None
    keys: Mapping[str, str] = field(default_factory=dict)
    template: str = ""
    dedupe_key: str | None = None
    rcpt_results: Mapping[str, RcptResult] = field(default_factory=dict)
    upstream: str = ""
    refusals: Mapping[str, RcptResult] = field(default_factory=dict)
    decided_at: float = 0.0
    admitted: bool = True
    trace_id: str = ""
    key_source: str = ""
    reused: frozenset[str] = frozenset()
    received_at: float | None = None
    sending_at: float | None = None


class DecisionObserver(Protocol):
    """Sees every finished decision, once per message, after the reply is fixed."""

    def decided(self, msg: InboundMessage, decision: Decision) -> None:
        """Take note of ``decision`` on ``msg``; returns at once and never raises."""
        ...


class Admission(Protocol):
    """Decides before anything else whether a new message may be taken at all."""

    def admits(self) -> bool:
        """False: the message is answered ``451 4.3.0`` before anything is reserved."""
        ...


class MessageCore(Protocol):
    """What the listener hands each message to: :class:`relay.core.dedup.DedupCore`, or the
    core in its span (:class:`relay.ops.traced.TracedCore`)."""

    async def process(self, msg: InboundMessage) -> Decision:
        """The decision on ``msg``, seen by every observer; never raises for a store or
        upstream failure."""
        ...
