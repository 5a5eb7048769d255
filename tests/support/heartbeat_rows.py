"""The rows of the SENDING heartbeat rule (:func:`relay.core.rules.heartbeat_state`), shared by
the rule's own test (tests/core/test_rules.py) and the test of its Lua twin in the Redis reserve
script (tests/store/test_redis_sending_rule.py): one table, two judges."""

from __future__ import annotations

import pytest

from relay.core.interfaces import State

HEARTBEAT = [
    # (heartbeat age s, the writer's own lease s, the reader's lease s) -> the state
    pytest.param(0.0, None, 900.0, State.PENDING, id="fresh-heartbeat-is-in-flight"),
    pytest.param(899.999, None, 900.0, State.PENDING, id="younger-than-the-lease-is-in-flight"),
    pytest.param(900.0, None, 900.0, State.UNKNOWN, id="a-lease-old-is-in-doubt"),
    pytest.param(60.0, 30.0, 900.0, State.UNKNOWN,
                 id="the-writers-shorter-lease-decides-over-the-readers"),
    pytest.param(600.0, 3600.0, 900.0, State.PENDING,
                 id="the-writers-longer-lease-decides-over-the-readers"),
    pytest.param(-5.0, None, 900.0, State.PENDING, id="a-heartbeat-from-the-future-is-fresh"),
]
