"""The SMTP listener's settings: where it listens, the name it gives, and the limits of a
session (RFC 5321 section 4.5.3); built into :class:`relay.smtp.handler.ListenerLimits`."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, field_validator

from relay.settings.common import Section, check_domain_name, split_host_port

if TYPE_CHECKING:
    from relay.smtp.handler import ListenerLimits

class ListenerSettings(Section):
    """Where the SMTP listener listens and the limits of one client session."""

    TITLE: ClassVar[str] = "Listener"

    listen: str = Field("127.0.0.1:2525", description=(
        "SMTP listener HOST:PORT ([::1]:2525 for IPv6; port 0: any free port)"))
    hostname: str = Field(default_factory=socket.getfqdn, description=(
        "name in the greeting, the EHLO reply and the Received: header"))
    max_message_size: int = Field(default=10 * 1024 * 1024, ge=1024, description=(
        "bytes; advertised as SIZE, a larger message is refused with 552 5.3.4"))
    max_recipients: int = Field(default=1000, ge=1, description=(
        "RCPT TO per message; more are refused with 452 4.5.3 (RFC 5321 section 4.5.3.1.8), "
        "not counted as idle commands"))
    client_timeout: float = Field(default=300.0, gt=0, description=(
        "seconds a client may stay silent; then 421 4.4.2 and the connection is closed"))
    data_deadline: float = Field(default=600.0, gt=0, description=(
        "seconds a client has from DATA's 354 to the final dot; then 421 4.4.2"))
    session_lifetime: float = Field(default=3600.0, gt=0, description=(
        "seconds a session may last; then 421 4.4.2 (a message in DATA is answered first)"))
    max_idle_commands: int = Field(default=100, ge=1, description=(
        "commands since the session's last message (NOOP, RSET, refused MAIL/RCPT/DATA...); "
        "then 421 4.7.0"))
    bare_newline: Literal["normalize", "reject"] = Field("normalize", description=(
        "a message line ending in a bare LF: normalize takes it as CRLF (only <CRLF>.<CRLF> "
        "ends DATA), reject refuses the message with 550 5.6.0; a bare CR is always refused"))
    add_message_id: bool = Field(True, description=(
        "a message without a Message-ID header gets Message-ID: <QUEUE-ID@hostname> before "
        "it goes upstream (RFC 5322 section 3.6.4, as MTAs add one), so the ledger records "
        "one for every message and the reconciler can look it up; a message with one is sent "
        "unchanged"))

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        split_host_port(value, what="listen")
        return value

    @field_validator("hostname")
    @classmethod
    def _check_hostname(cls, value: str) -> str:
        return check_domain_name(value, what="hostname")  # the greeting, Received: header

    @property
    def listen_address(self) -> tuple[str, int]:
        """``(host, port)`` of the SMTP listener."""
        return split_host_port(self.listen, what="listen")

    def listener_limits(self, *, allowed_senders: tuple[str, ...],
                        local_part_case_sensitive: bool, log_recipients: bool,
                        console_url: str | None = None) -> ListenerLimits:
        """The session limits of :class:`relay.smtp.handler.ListenerLimits`, with the senders
        allowed, how recipients compare, whether they are logged in full and the console's
        external URL (the decision log line's link)."""
        from relay.smtp.handler import ListenerLimits

        return ListenerLimits(
            hostname=self.hostname, max_recipients=self.max_recipients,
            max_message_size=self.max_message_size, client_timeout_s=self.client_timeout,
            data_deadline_s=self.data_deadline, session_lifetime_s=self.session_lifetime,
            max_idle_commands=self.max_idle_commands, bare_newline=self.bare_newline,
            local_part_case_sensitive=local_part_case_sensitive,
            log_recipients=log_recipients, allowed_senders=allowed_senders,
            console_url=console_url, add_message_id=self.add_message_id)
