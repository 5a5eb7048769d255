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

from relay.core import replies
from relay.core.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    OutboundMessage,
    RcptResult,
    RcptStatus,
    SmtpReply,
)

_STORED = SmtpReply(250, "2.0.0", "Ok: stored in Maildir")


def _failed(exc: OSError | mailbox.Error) -> RcptResult:
    """The temporary refusal of a recipient whose file could not be written."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return RcptResult(RcptStatus.REFUSED,
                      SmtpReply(451, "4.3.0", f"Maildir delivery failed: {reason}"))


class MaildirUpstream:
    """Delivers into the Maildir at ``path`` (created when missing); an Upstream."""

    def __init__(self, *, path: Path) -> None:
        self._path = path

    def _deliver_sync(self, message: OutboundMessage) -> dict[str, RcptResult]:
        """Write each recipient's file; each recipient's result is its own write's.

        A recipient whose file was written is ACCEPTED even when a later one fails: refusing
        it would release its reservation and the retry would write it twice (design.md §1).
        """
        try:
            box = mailbox.Maildir(self._path, create=True)
        except OSError as exc:
            return dict.fromkeys(message.rcpt_tos, _failed(exc))
        sender = message.mail_from
        results: dict[str, RcptResult] = {}
        for rcpt in message.rcpt_tos:
            trace = f"Return-Path: <{sender}>\r\nDelivered-To: {rcpt}\r\n".encode()
            try:
                box.add(trace + message.content)
            except (OSError, mailbox.Error) as exc:
                results[rcpt] = _failed(exc)
            else:
                results[rcpt] = RcptResult(RcptStatus.ACCEPTED, _STORED)
        return results

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        """Write one file per recipient; a filesystem error refuses that recipient temporarily
        (``451 4.3.0``), the others keep their own outcome."""
        if progress is not None:
            if progress.before_dot is not None and not await progress.before_dot(
                    message.rcpt_tos):
                return DeliveryResult(recipients={
                    r: RcptResult(RcptStatus.REFUSED, progress.abort_reply or replies.STORE_DOWN,
                                  from_upstream=False)
                    for r in message.rcpt_tos})
            progress.dot_written = True  # the writing thread cannot be stopped once started
        results = await asyncio.to_thread(self._deliver_sync, message)
        accepted = any(r.status is RcptStatus.ACCEPTED for r in results.values())
        return DeliveryResult(recipients=results, final_reply=_STORED if accepted else None)

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
