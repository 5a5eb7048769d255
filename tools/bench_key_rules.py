"""CPU per message of deriving its key (relay.core.keys.derive_key) with 0 and 10
``[[key_rule]]`` tables: what the rules add to each message without a key header; and of its
content digest (:meth:`relay.core.keys.DerivedKey.content_digest`), which every message the
relay reserves computes once (design.md §2.2).

    .venv/bin/python tools/bench_key_rules.py [--messages N]

Prints microseconds of process CPU time per message for: no rules; 10 rules of which the last
matches by a subject pattern; 10 rules of which the last is a ``content`` rule (the body
decoded and normalized); a message with a key header (the rules never run); then the content
digest of a message with a key header: a short receipt (Django's ``send_mail``, 8 lines), the
40-line quoted-printable message above (every line a date, a URL with a token), and the short
receipt with a 1 MiB PDF attached."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from email.message import EmailMessage

from relay.core.headers import parse_message
from relay.core.key_rules import KeyRule, build_rule
from relay.core.keys import KeyRules, derive_key


def _message(with_key: bool) -> bytes:
    msg = EmailMessage()
    msg["From"] = "shop@shop.example"
    msg["To"] = "jane@example.net"
    msg["Subject"] = "Your receipt for Order #1042"
    msg["Message-ID"] = "<170470440012.4242.1@app.example>"
    if with_key:
        msg["X-Dedupe-Key"] = "order-1042"
    body = "".join(f"Line {i}: item {i} at 2024-01-08 09:00, https://shop.example/i/{i}?tk=ab"
                   f"c{i:06d}def\n" for i in range(40))
    msg.set_content(body, charset="utf-8", cte="quoted-printable")
    return msg.as_bytes(policy=msg.policy.clone(linesep="\r\n"))


def _rules(last_key: str) -> tuple[KeyRule, ...]:
    misses = tuple(build_rule(name=f"other-{i}", key=r"subject:Invoice (\d+)",
                              sender=f"*@vendor{i}.example") for i in range(9))
    return (*misses, build_rule(name="shop", key=last_key, sender="*@shop.example",
                                template="receipt"))


def cpu_us_per_message(content: bytes, rules: Sequence[KeyRule], count: int) -> float:
    """Process CPU microseconds per :func:`derive_key` of ``content`` (parsed each time, as
    the listener does) under ``rules``."""
    policy = KeyRules(key_rules=tuple(rules))
    started = time.process_time()
    for _ in range(count):
        message = parse_message(content)
        derive_key(message, message.dedup_headers(), policy, mail_from="shop@shop.example",
                   rcpt_tos=["jane@example.net"])
    return (time.process_time() - started) / count * 1e6


def _short(attachment: bool) -> bytes:
    msg = EmailMessage()
    msg["From"] = "shop@shop.example"
    msg["To"] = "jane@example.net"
    msg["Subject"] = "Your receipt for Order #1042"
    msg["X-Dedupe-Key"] = "order-1042"
    msg.set_content("Hello Jane,\n\nThanks for your order #1042 of 2024-01-08.\n"
                    "Total: 42.00 EUR\nTrack it: https://shop.example/t/1042?tk=Zx9Yw8Vu7Ts6\n"
                    "\nThe Shop\n")
    if attachment:
        msg.add_attachment(bytes(range(256)) * 4096, maintype="application", subtype="pdf",
                           filename="receipt.pdf")
    return msg.as_bytes(policy=msg.policy.clone(linesep="\r\n"))


def digest_us_per_message(content: bytes, count: int) -> float:
    """Process CPU microseconds per content digest of ``content`` (parsed each time)."""
    policy = KeyRules()
    started = time.process_time()
    for _ in range(count):
        message = parse_message(content)
        derive_key(message, message.dedup_headers(), policy, mail_from="shop@shop.example",
                   rcpt_tos=["jane@example.net"]).content_digest()
    return (time.process_time() - started) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    count = parser.parse_args().messages
    plain, keyed = _message(False), _message(True)
    for label, content, rules in (
            ("0 rules", plain, ()),
            ("10 rules, subject rule matches", plain, _rules(r"subject:Order #(\d+)")),
            ("10 rules, content rule matches", plain, _rules("content")),
            ("10 rules, key header (rules skipped)", keyed, _rules("content"))):
        print(f"{label:<40} {cpu_us_per_message(content, rules, count):8.1f} us/message")
    for label, content, times in (
            ("digest: short receipt", _short(False), count),
            ("digest: 40-line quoted-printable", keyed, count),
            ("digest: short receipt + 1 MiB PDF", _short(True), max(1, count // 20))):
        print(f"{label:<40} {digest_us_per_message(content, times):8.1f} us/message")


if __name__ == "__main__":
    main()
