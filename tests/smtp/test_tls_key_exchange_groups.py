"""The TLS listener agrees to Mozilla's intermediate key exchange groups only (X25519,
prime256v1, secp384r1; relay.smtp.tls.TLS_GROUPS): a real ``openssl s_client`` offering only
X448 or only secp521r1 fails its handshake, over TLS 1.3 and TLS 1.2. The server's key is RSA,
so under TLS 1.2 the groups a client offers limit the key exchange only, not the certificate
(an ECDSA P-256 key would need prime256v1 offered too)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import trustme

from relay.app import Relay
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture
async def relay(make_relay: MakeRelay, sink: Sink, tmp_path: Path) -> Relay:
    """A relay with its implicit-TLS port on a free port and an RSA certificate."""
    server = trustme.CA(key_type=trustme.KeyType.RSA).issue_cert(
        "relay.test", "127.0.0.1", key_type=trustme.KeyType.RSA)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    server.private_key_pem.write_to_path(str(key))
    cert.write_bytes(b"".join(pem.bytes() for pem in server.cert_chain_pems))
    return await make_relay(upstream=f"127.0.0.1:{sink.port}", tls_cert=cert, tls_key=key,
                            tls_listen="127.0.0.1:0")


async def s_client(port: int, version: str, groups: str) -> str:
    """Run ``openssl s_client`` against ``port`` offering only ``groups`` over ``version``
    (``tls1_2`` or ``tls1_3``); its output (stdout and stderr together)."""
    process = await asyncio.create_subprocess_exec(
        "openssl", "s_client", "-connect", f"127.0.0.1:{port}", f"-{version}",
        "-groups", groups, "-servername", "relay.test",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    output, _ = await asyncio.wait_for(process.communicate(), 20)
    return output.decode(errors="replace")


@pytest.mark.parametrize("version", ["tls1_3", "tls1_2"])
@pytest.mark.parametrize("group", ["X25519", "prime256v1", "secp384r1"])
async def test_a_client_offering_an_intermediate_group_completes_its_handshake(
    relay: Relay, version: str, group: str
) -> None:
    """A client offering only X25519, prime256v1 or secp384r1 completes the handshake with it."""
    output = await s_client(relay.tls_port, version, group)
    assert "Cipher is (NONE)" not in output, output
    temp_key = next(line for line in output.splitlines() if "Server Temp Key:" in line)
    assert group in temp_key, output


@pytest.mark.parametrize("version", ["tls1_3", "tls1_2"])
@pytest.mark.parametrize("group", ["X448", "secp521r1"])
async def test_a_client_offering_only_x448_or_secp521r1_is_refused(
    relay: Relay, version: str, group: str
) -> None:
    """A client offering only X448 or only secp521r1 gets a handshake failure, no session."""
    output = await s_client(relay.tls_port, version, group)
    assert "Cipher is (NONE)" in output or "handshake failure" in output, output
    assert "Server Temp Key" not in output, output
