"""The I/O-free core: value types and Protocols, errors, the reply catalogue, address and
header parsing, the fingerprint, the decision rules, ``DedupCore`` and settlement.

Imports no socket, SMTP, store, HTTP, metrics, settings or CLI library (import-linter checks it).
"""
