"""The fake smarthost: a real aiosmtpd server whose handler scripts faults and records what
it accepted."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from aiosmtpd.smtp import SMTP, Envelope, Session


@dataclass
class Delivered:
    """One message the sink accepted."""

    mail_from: str
    rcpt_tos: list[str]
    content: bytes
    mail_options: list[str]
    helo: str = ""  # the name the client gave in EHLO / HELO


@dataclass
class SinkHandler:
    """aiosmtpd handler of the fake smarthost; its plans script faults per test.

    ``rcpt_plan[address]`` and ``data_plan`` are queues of replies used one per call (then
    250); ``mail_plan`` likewise for MAIL; ``hang_after_dot_s`` delays the reply to the final
    dot; ``delay_s`` delays every DATA reply (to hold a transaction open); ``rcpt_limit`` (0:
    none) answers ``452 4.5.3`` to every RCPT past that many in one transaction, as Postfix's
    ``smtpd_recipient_limit`` does.
    """

    delivered: list[Delivered] = field(default_factory=list)
    transactions: int = 0
    rcpt_plan: dict[str, deque[str]] = field(default_factory=dict)
    data_plan: deque[str] = field(default_factory=deque)
    mail_plan: deque[str] = field(default_factory=deque)
    hang_after_dot_s: float = 0.0
    delay_s: float = 0.0
    mail_delay_s: float = 0.0
    rcpt_limit: int = 0
    mail_commands: list[tuple[str, list[str]]] = field(default_factory=list)
    rcpt_commands: list[str] = field(default_factory=list)

    async def handle_MAIL(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, options: list[str]) -> str:
        self.transactions += 1
        self.mail_commands.append((address, options))
        if self.mail_delay_s:
            await asyncio.sleep(self.mail_delay_s)
        if self.mail_plan:
            return self.mail_plan.popleft()
        envelope.mail_from = address
        envelope.mail_options.extend(options)
        return "250 2.1.0 OK"

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, options: list[str]) -> str:
        self.rcpt_commands.append(address)
        if self.rcpt_limit and len(envelope.rcpt_tos) >= self.rcpt_limit:
            return "452 4.5.3 Error: too many recipients"
        plan = self.rcpt_plan.get(address)
        if plan:
            reply = plan.popleft()
            if not reply.startswith("250"):
                return reply
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        reply = self.data_plan.popleft() if self.data_plan else "250 2.0.0 Ok: queued as SINK1"
        if reply.startswith("250"):
            assert envelope.mail_from is not None and envelope.original_content is not None
            self.delivered.append(Delivered(
                envelope.mail_from, list(envelope.rcpt_tos), envelope.original_content,
                list(envelope.mail_options), str(session.host_name or "")))
        if self.hang_after_dot_s:
            await asyncio.sleep(self.hang_after_dot_s)
        return reply

    def copies_to(self, address: str) -> int:
        """How many accepted messages were addressed to ``address`` (exact spelling)."""
        return sum(d.rcpt_tos.count(address) for d in self.delivered)


@dataclass
class Sink:
    """A running sink: ``port`` to relay to, ``handler`` to script and inspect."""

    handler: SinkHandler
    port: int
    server: asyncio.base_events.Server


async def start_sink(*, smtputf8: bool = True, eight_bit: bool = True,
                     handler: SinkHandler | None = None) -> Sink:
    """Serve ``handler`` (default: a new SinkHandler) on 127.0.0.1:0 in the running loop."""
    handler = handler if handler is not None else SinkHandler()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: SMTP(handler, hostname="sink.test", decode_data=not eight_bit,
                     enable_SMTPUTF8=smtputf8, data_size_limit=50 * 1024 * 1024),
        host="127.0.0.1", port=0)
    return Sink(handler=handler, port=server.sockets[0].getsockname()[1], server=server)
