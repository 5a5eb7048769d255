"""A local Maildir as the upstream: ``--upstream maildir:PATH``.

For staging, application CI and the README quick start: the relay runs end to end on one
machine with nothing else installed. Each accepted recipient gets one file, like a local
delivery agent writes it (``Return-Path:`` and ``Delivered-To:`` prepended, RFC 5321
section 4.4), so what "went upstream" can be counted per recipient. Uses stdlib ``mailbox``.
"""

from __future__ import annotations

import asyncio
import errno
import mailbox
import os
from pathlib import Path

from relay import replies
from relay.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    OutboundMessage,
    RcptResult,
    RcptStatus,
    SmtpReply,
)

_STORED = SmtpReply(250, "2.0.0 Ok: stored in Maildir")


class MaildirUpstream:
    """Delivers into the Maildir at ``path`` (created when missing); an Upstream."""

    def __init__(self, *, path: Path) -> None:
        self._path = path

    def _deliver_sync(self, message: OutboundMessage) -> None:
        box = mailbox.Maildir(self._path, create=True)
        sender = message.mail_from
        for rcpt in message.rcpt_tos:
            trace = f"Return-Path: <{sender}>\r\nDelivered-To: {rcpt}\r\n".encode()
            box.add(trace + message.content)

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        """Write one file per recipient; a filesystem error refuses all of them temporarily."""
        if progress is not None:
            if progress.before_dot is not None and not await progress.before_dot(
                    message.rcpt_tos):
                return DeliveryResult(recipients={
                    r: RcptResult(RcptStatus.REFUSED, replies.STORE_DOWN, from_upstream=False)
                    for r in message.rcpt_tos})
            progress.dot_written = True  # the writing thread cannot be stopped once started
        try:
            await asyncio.to_thread(self._deliver_sync, message)
        except OSError as exc:
            reply = SmtpReply(451, f"4.3.0 Maildir delivery failed: {exc.strerror}")
            status = RcptStatus.REFUSED
        else:
            reply, status = _STORED, RcptStatus.ACCEPTED
        return DeliveryResult(
            recipients={r: RcptResult(status, reply) for r in message.rcpt_tos},
            final_reply=reply if status is RcptStatus.ACCEPTED else None,
        )

    async def ping(self) -> None:
        """Raise ConnectionError when the Maildir cannot be created or written.

        ``mailbox.Maildir`` accepts a path that is a plain file (it only creates a missing
        one), so the ``tmp``/``new`` directories are checked as deliveries use them.
        """
        try:
            await asyncio.to_thread(self._check_sync)
        except OSError as exc:
            raise ConnectionError(f"maildir {self._path}: {exc.strerror}") from exc

    def _check_sync(self) -> None:
        mailbox.Maildir(self._path, create=True)
        for sub in ("tmp", "new"):
            directory = self._path / sub
            if not directory.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a Maildir (no tmp/ and new/)")
            if not os.access(directory, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, f"{sub}/ is not writable")

    async def close(self) -> None:
        """Nothing to close."""
