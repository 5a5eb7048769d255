"""TLS for the listener: the server context for STARTTLS (RFC 3207) and implicit TLS (RFC 8314)."""

from __future__ import annotations

import ssl
from pathlib import Path

from relay.core.errors import ConfigError

_VERSIONS = {"TLSv1.2": ssl.TLSVersion.TLSv1_2, "TLSv1.3": ssl.TLSVersion.TLSv1_3}
# Mozilla's "intermediate" TLS 1.2 suites (ssl-config.mozilla.org, guideline 5.7): forward
# secrecy and AEAD only, no CBC; the DHE ones are left out (no DH parameters are loaded).
# TLS 1.3 suites are all AEAD and not affected by set_ciphers.
TLS12_CIPHERS = ":".join([
    "ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384", "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305", "ECDHE-RSA-CHACHA20-POLY1305",
])


def server_context(cert: Path, key: Path, min_version: str = "TLSv1.2") -> ssl.SSLContext:
    """A server-side SSLContext with the certificate chain ``cert`` and its private ``key``.

    ``min_version`` is ``TLSv1.2`` or ``TLSv1.3`` (RFC 8996 retired older ones); TLS 1.2
    offers :data:`TLS12_CIPHERS` only. Raises ConfigError when the files cannot be read or
    do not match.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = _VERSIONS[min_version]
    context.set_ciphers(TLS12_CIPHERS)
    try:
        context.load_cert_chain(certfile=str(cert), keyfile=str(key))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls-cert/tls-key: cannot load {cert} / {key}: {exc}") from exc
    return context
