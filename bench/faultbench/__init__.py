"""The fault bench's library: relays under faults of their store, upstream and clock, the
traffic and its checks (``tools/faultbench.py``, docs/reliability.md) and the nemesis mode
(``tools/faultbench.py --nemesis``); the system tests under tests/system/ run short versions."""
