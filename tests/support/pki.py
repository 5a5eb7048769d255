"""TLS parts of the tests: a throw-away CA and server certificate (trustme), a relay with
STARTTLS and implicit TLS, STARTTLS on a raw client."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import trustme

from relay.app import Relay
from tests.support.clients import RawClient
from tests.support.relays import MakeRelay
from tests.support.sink import Sink


@dataclass
class Pki:
    """A throw-away CA and a server certificate for 127.0.0.1 / relay.test."""

    cert: Path
    key: Path
    client_context: ssl.SSLContext
    ca_file: Path


def make_pki(folder: Path) -> Pki:
    """Certificates made with trustme in ``folder`` (no network, no openssl CLI)."""
    ca = trustme.CA()
    server = ca.issue_cert("relay.test", "127.0.0.1")
    cert, key, ca_file = folder / "cert.pem", folder / "key.pem", folder / "ca.pem"
    server.private_key_pem.write_to_path(str(key))
    key.chmod(0o600)  # a private key as an operator keeps it (the relay warns otherwise)
    server.cert_chain_pems[0].write_to_path(str(cert))
    for extra in server.cert_chain_pems[1:]:
        with cert.open("ab") as out:
            out.write(extra.bytes())
    ca.cert_pem.write_to_path(str(ca_file))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return Pki(cert=cert, key=key, client_context=context, ca_file=ca_file)


async def tls_relay(make_relay: MakeRelay, sink: Sink, pki: Pki, **extra: object) -> Relay:
    """A relay with STARTTLS, implicit TLS on a free port and the given extra settings."""
    settings: dict[str, object] = {
        "upstream": f"127.0.0.1:{sink.port}", "tls_cert": pki.cert, "tls_key": pki.key,
        "tls_listen": "127.0.0.1:0"}
    settings.update(extra)
    return await make_relay(**settings)


async def starttls(client: RawClient, context: ssl.SSLContext) -> None:
    """STARTTLS on a RawClient's connection (the client said EHLO already)."""
    assert (await client.cmd("STARTTLS")).startswith("220")
    await client.writer.start_tls(context, server_hostname="relay.test")
