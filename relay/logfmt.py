"""Logging set-up and the masking of addresses in logs (no secrets, no bodies, DESIGN 5)."""

from __future__ import annotations

import logging
import sys


def mask_address(address: str) -> str:
    """Mask the local part of ``address``: ``john.doe@example.com`` -> ``j***@example.com``."""
    local, at, domain = address.rpartition("@")
    if not at:
        return address[:1] + "***"
    return f"{local[:1]}***@{domain}"


def setup_logging(level: str) -> None:
    """Send the relay's logs to stderr, one line per record, at ``level`` (``INFO`` ...)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # aiosmtpd logs every command line at INFO, recipients included: keep it at WARNING
    logging.getLogger("mail.log").setLevel(max(logging.WARNING, root.level))
