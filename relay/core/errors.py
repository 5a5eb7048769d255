"""The one exception tree of dedup-relay.

::

    RelayError
    ├── ConfigError            settings are invalid (check-config prints it, exit 2)
    ├── StoreError             the fingerprint store failed or timed out (redis/sqlite errors
    │                          are translated into this at the adapter boundary)
    ├── InvalidAddressError    an envelope address cannot be normalized (bad IDNA, control chars)
    └── InvalidDedupKeyError   a dedupe key or template is longer than allowed or holds control
                               characters (design.md §2: answered ``554 5.6.0``)

Adapters translate their library's exceptions into this tree so that the core (``dedup``)
never imports redis, sqlite3 or aiosmtplib.
"""

from __future__ import annotations


class RelayError(Exception):
    """Base class of every error the relay raises on purpose."""


class ConfigError(RelayError):
    """Settings are invalid; the message is readable by an operator."""


class StartupError(RelayError):
    """The relay cannot start (a port in use, an unopenable store, an unreadable file...);
    the message is one readable line for the operator."""


class StoreError(RelayError):
    """The fingerprint store failed, refused or timed out.

    ``op`` names the store operation (``reserve``, ``settle``, ``inspect``, ``ping``) for the
    ``relay_store_errors_total{op}`` metric.
    """

    def __init__(self, op: str, message: str) -> None:
        super().__init__(f"{op}: {message}")
        self.op = op


class InvalidAddressError(RelayError):
    """An envelope address cannot be normalized into a fingerprint input."""


class InvalidDedupKeyError(RelayError):
    """A dedupe key or template value breaks the rules of design.md §2."""
