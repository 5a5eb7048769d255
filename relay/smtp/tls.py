"""TLS for the listener: the server context for STARTTLS (RFC 3207) and implicit TLS (RFC 8314)."""

from __future__ import annotations

import _ssl  # the extension module behind ssl: its libssl made every SSLContext
import contextlib
import ctypes
import os
import ssl
from collections.abc import Iterator
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

# Mozilla's "intermediate" key exchange groups (ssl-config.mozilla.org, guideline 5.7), in the
# server's order of preference: X448 and secp521r1, which OpenSSL offers too, are left out.
TLS_GROUPS = ("X25519", "prime256v1", "secp384r1")
_SSL_CTRL_SET_GROUPS_LIST = 92  # openssl/ssl.h: the ctrl behind SSL_CTX_set1_groups_list


def set_groups(context: ssl.SSLContext, groups: tuple[str, ...]) -> None:
    """Limit the (EC)DHE key exchange groups ``context`` agrees to (TLS 1.2 curves, RFC 8422
    section 5.1; TLS 1.3 groups, RFC 8446 section 4.2.7) to ``groups`` (OpenSSL names).

    Python's ssl has no call for it (``set_ecdh_curve`` keeps one curve), so this calls
    OpenSSL's ``SSL_CTX_set1_groups_list`` through ctypes in the libssl Python's ``_ssl``
    uses, on the ``SSL_CTX`` pointer that CPython keeps right after the object header. The
    pointer is checked first (OpenSSL's options read through it must equal
    ``context.options``). Raises ConfigError when the check or the call fails.
    """
    lib = ctypes.CDLL(getattr(_ssl, "__file__", None))  # None: linked into the interpreter
    lib.SSL_CTX_get_options.restype = ctypes.c_uint64
    lib.SSL_CTX_get_options.argtypes = [ctypes.c_void_p]
    lib.SSL_CTX_ctrl.restype = ctypes.c_long
    lib.SSL_CTX_ctrl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_char_p]
    ctx = ctypes.c_void_p.from_address(id(context) + object.__basicsize__).value
    if not ctx or lib.SSL_CTX_get_options(ctx) != int(context.options):
        raise ConfigError("TLS: cannot reach OpenSSL's SSL_CTX to limit the key exchange groups")
    if lib.SSL_CTX_ctrl(ctx, _SSL_CTRL_SET_GROUPS_LIST, 0, ":".join(groups).encode()) != 1:
        raise ConfigError(f"TLS: OpenSSL refused the key exchange groups {':'.join(groups)}")


def server_context(cert: Path, key: Path, min_version: str = "TLSv1.2") -> ssl.SSLContext:
    """A server-side SSLContext with the certificate chain ``cert`` and its private ``key``.

    ``min_version`` is ``TLSv1.2`` or ``TLSv1.3`` (RFC 8996 retired older ones); TLS 1.2
    offers :data:`TLS12_CIPHERS` only; both versions agree to the groups :data:`TLS_GROUPS`
    only (:func:`set_groups`). Raises ConfigError when the files cannot be read or
    do not match.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = _VERSIONS[min_version]
    context.set_ciphers(TLS12_CIPHERS)
    set_groups(context, TLS_GROUPS)
    try:
        context.load_cert_chain(certfile=str(cert), keyfile=str(key))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls-cert/tls-key: cannot load {cert} / {key}: {exc}") from exc
    return context


@contextlib.contextmanager
def _memory_copy(data: bytes, name: str) -> Iterator[str]:
    """A path to a private in-memory copy of ``data`` (Linux memfd), so that a file read
    twice is the same both times; the bytes are not written to a disk. Raises OSError."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def rotate_certificate(context: ssl.SSLContext, cert: Path, key: Path,
                       min_version: str = "TLSv1.2") -> None:
    """Load the certificate chain ``cert`` and its ``key`` into the live server ``context``:
    every later handshake (STARTTLS, the implicit-TLS listener) is served the new chain; those
    done keep theirs. Each file is read once; the pair is first loaded into a fresh context,
    so a pair that does not load leaves ``context`` as it was. Raises :class:`ConfigError`."""
    try:
        cert_bytes, key_bytes = cert.read_bytes(), key.read_bytes()
    except OSError as exc:
        raise ConfigError(f"tls_cert/tls_key: cannot read {cert} / {key}: {exc}") from exc
    try:
        with _memory_copy(cert_bytes, "tls-cert") as cert_copy, \
                _memory_copy(key_bytes, "tls-key") as key_copy:
            server_context(Path(cert_copy), Path(key_copy), min_version)
            context.load_cert_chain(certfile=cert_copy, keyfile=key_copy)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("/proc/self/fd/", "fd ")
                          + f" (tls_cert {cert}, tls_key {key})") from exc
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_cert/tls_key: cannot load {cert} / {key}: {exc}") from exc
