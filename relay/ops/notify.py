"""systemd's service notification protocol (sd_notify(3)): ``READY=1`` once the relay serves,
``STOPPING=1`` when it begins to stop, ``WATCHDOG=1`` every half of ``WatchdogSec`` while it
runs. One datagram to the ``AF_UNIX`` socket ``NOTIFY_SOCKET`` names (a leading ``@``: the
abstract namespace); without ``NOTIFY_SOCKET`` (not run by systemd with ``Type=notify``)
nothing is sent. Never raises."""

from __future__ import annotations

import asyncio
import os
import socket


def notify(*fields: str) -> bool:
    """Send ``fields`` (``READY=1``, ``STATUS=...``) as one notification; True when sent."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(fields).encode(), address)
    except OSError:
        return False
    return True


def watchdog_interval_s() -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half of ``WATCHDOG_USEC`` (systemd's
    ``WatchdogSec``), when it is set for this process (``WATCHDOG_PID`` unset or ours)."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1e6 / 2


async def keep_watchdog(interval_s: float) -> None:
    """Ping the watchdog every ``interval_s`` seconds until cancelled: a relay whose event
    loop stalls stops pinging, and systemd restarts it."""
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval_s)
