"""AUTH logins per second against a real relay (STARTTLS + AUTH PLAIN, a new connection each).

Usage::

    python tools/auth_logins.py [--repo DIR] [--scheme argon2|bcrypt] [--clients N] [--seconds S]

Starts ``DIR/.venv/bin/python -m relay serve --workers 1`` (default: this repository) with a
trustme certificate, a users file holding one user hashed with ``--scheme`` (the
hash-password defaults: argon2id 64 MiB, bcrypt cost 12), a Maildir upstream and a SQLite
store in a temporary folder; ``--clients`` clients each loop connect, STARTTLS, AUTH PLAIN,
QUIT for ``--seconds``. Prints logins per second and the AUTH command's p50/p90 latency (ms).
``--repo`` points at another checkout (with its own ``.venv``) to measure the code before a
change on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiosmtplib
import trustme

PASSWORD = "auth-logins-password"  # noqa: S105  (the bench's own throwaway user)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _logins(port: int, context: ssl.SSLContext, clients: int, seconds: float
                  ) -> tuple[int, float, list[float]]:
    """(logins, elapsed seconds, AUTH latencies in seconds) of ``clients`` looping clients."""
    for _ in range(100):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            break
        except OSError:
            await asyncio.sleep(0.1)
    latencies: list[float] = []
    end = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < end:
            smtp = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, tls_context=context,
                                   start_tls=True)
            await smtp.connect()
            started = time.monotonic()
            await smtp.login("app", PASSWORD)
            latencies.append(time.monotonic() - started)
            await smtp.quit()

    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    return len(latencies), time.monotonic() - started, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--scheme", choices=("argon2", "bcrypt"), default="argon2")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    python = str(args.repo / ".venv" / "bin" / "python")
    work = Path(tempfile.mkdtemp(prefix="auth-logins-"))
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(work / "cert.pem"))
    cert.private_key_pem.write_to_path(str(work / "key.pem"))
    hashed = subprocess.run(
        [python, "-c", "import sys; from relay.credentials import hash_password; "
         "print(hash_password(sys.argv[1], scheme=sys.argv[2]))", PASSWORD, args.scheme],
        capture_output=True, text=True, check=True).stdout.strip()
    (work / "users").write_text(f"app:{hashed}\n", encoding="utf-8")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    with (work / "relay.log").open("wb") as log:
        relay = subprocess.Popen(
            [python, "-m", "relay", "serve", "--workers", "1", "--listen", f"127.0.0.1:{port}",
             "--upstream", f"maildir:{work / 'md'}", "--store", f"sqlite:///{work / 'd.db'}",
             "--metrics-listen", "off", "--tls-cert", str(work / "cert.pem"),
             "--tls-key", str(work / "key.pem"), "--auth-file", str(work / "users"),
             "--log-level", "WARNING"], cwd=work, env=env, stdout=log, stderr=log)
    context = ssl.create_default_context()
    ca.configure_trust(context)
    try:
        done, elapsed, latencies = asyncio.run(
            _logins(port, context, args.clients, args.seconds))
    finally:
        relay.terminate()
        relay.wait(timeout=30)
    if len(latencies) < 2:
        sys.exit(f"only {done} login(s): see {work / 'relay.log'}")
    p90 = statistics.quantiles(latencies, n=10)[-1]
    print(f"{args.scheme} clients={args.clients} logins={done} "
          f"logins/s={done / elapsed:.1f} auth p50={statistics.median(latencies) * 1000:.1f} ms "
          f"p90={p90 * 1000:.1f} ms")


if __name__ == "__main__":
    main()
