"""dedup-relay: an SMTP relay proxy that stops duplicate outbound email.

For every envelope recipient of a message carrying an ``X-Dedupe-Key`` header the relay derives a
fingerprint, reserves it atomically in a store (Redis, or an embedded SQLite file), relays the
message to the upstream smarthost and settles the reservation by the upstream's reply.
"""

__version__ = "0.1.0"
