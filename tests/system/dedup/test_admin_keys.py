"""The admin commands and a running relay derive the same store key from the same input
(both call relay.core.keys): what ``dedup-relay fingerprint`` prints is what the relay reserved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis.asyncio as aredis
from pydantic import SecretStr

from relay.admin import FingerprintInput, key_for
from relay.app import Relay
from tests.support.cli import run_cli
from tests.support.clients import send
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

# two keys (one through the Idempotency-Key alias, with blanks to collapse) and an RFC 2047
# template: the relay reads them from the header section, the admin gets them as given
KEYS = ["order-42", "  Order \t 43 "]
TEMPLATES = ["=?utf-8?q?Willkommen_=C3=BCbersicht?="]
MESSAGE = (
    "From: app@example.com\r\nTo: several@example.net\r\nSubject: keys\r\n"
    f"X-Dedupe-Key: {KEYS[0]}\r\nIdempotency-Key:{KEYS[1]}\r\n"
    f"X-Template: {TEMPLATES[0]}\r\n\r\nhello\r\n"
).encode()
RCPTS = ["User@Example.NET", "second.user@EXAMPLE.org", "jörg@bücher.example"]


async def _stored(relay: Relay) -> set[str]:
    client = aredis.Redis.from_url(relay.settings.store)
    try:
        return {k.decode() async for k in client.scan_iter(
            match=relay.settings.store_prefix + "*")}
    finally:
        await client.aclose()


@pytest.mark.parametrize("settings", [
    pytest.param({}, id="defaults"),
    pytest.param({"fingerprint_secret": "s3cret", "local_part_case_sensitive": True},
                 id="hmac-secret-and-case-sensitive-local-parts"),
    pytest.param({"store_key_format": "compact"}, id="compact-keys"),
])
async def test_the_admin_key_is_the_key_the_relay_reserved(
        make_relay: MakeRelay, sink: Sink, settings: dict[str, object]) -> None:
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", **settings)
    result = await send(relay.port, RCPTS, MESSAGE, mail_options=["SMTPUTF8"])
    assert result.code == 250 and "relayed 3" in result.text, result
    admin = {key_for(relay.settings, FingerprintInput(rcpt=r, templates=TEMPLATES, keys=KEYS))[1]
             for r in RCPTS}
    assert len(admin) == 3
    assert await _stored(relay) == admin
    suffix = len(relay.settings.store_prefix)
    assert {len(k) - suffix for k in admin} == {
        43 if relay.settings.store_key_format == "compact" else 64}


async def test_a_secret_file_keys_as_the_secret_it_holds(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path) -> None:
    """fingerprint_secret_file (a Docker/systemd secret, final newline included) gives the
    keys fingerprint_secret with its text gives, not the plain SHA-256 ones."""
    secret_file = tmp_path / "fp-secret"
    secret_file.write_text("s3cret\n")
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}",
                             fingerprint_secret_file=secret_file)
    result = await send(relay.port, RCPTS, MESSAGE, mail_options=["SMTPUTF8"])
    assert result.code == 250 and "relayed 3" in result.text, result

    def keys(**settings: object) -> set[str]:
        chosen = relay.settings.model_copy(update={"fingerprint_secret_file": None, **settings})
        return {key_for(chosen, FingerprintInput(rcpt=r, templates=TEMPLATES, keys=KEYS))[1]
                for r in RCPTS}

    stored = await _stored(relay)
    assert stored == keys(fingerprint_secret=SecretStr("s3cret"))
    assert stored.isdisjoint(keys())


async def test_the_admin_commands_find_a_compact_key(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path) -> None:
    """``fingerprint`` prints the compact key the relay wrote; ``inspect`` finds its SENT
    record by --rcpt/--key (the relay's own derivation) and by --store-key."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", store_key_format="compact")
    result = await send(relay.port, RCPTS[:1], MESSAGE)
    assert result.code == 250, result
    [stored] = await _stored(relay)
    assert len(stored) == len(relay.settings.store_prefix) + 43  # base64url of the digest
    env = {"RELAY_STORE": relay.settings.store, "RELAY_STORE_PREFIX": relay.settings.store_prefix,
           "RELAY_STORE_KEY_FORMAT": "compact"}
    given = ["--rcpt", RCPTS[0], "--key", KEYS[0], "--key", KEYS[1],
             "--template", TEMPLATES[0]]
    printed = json.loads(run_cli("fingerprint", *given, cwd=tmp_path, env=env).stdout)
    assert printed["key"] == stored and len(printed["fingerprint"]) == 64
    for selection in (given, ["--store-key", stored]):
        done = run_cli("inspect", *selection, cwd=tmp_path, env=env)
        assert done.returncode == 0, done
        seen = json.loads(done.stdout)
        assert (seen["key"], seen["state"]) == (stored, "sent") and seen["at"] is not None
