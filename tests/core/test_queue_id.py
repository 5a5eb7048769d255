"""The one parser of the queue id a smarthost names in its 2yz reply to the final dot
(relay/core/queue_id.py): one row per reply shape it knows; the decision's log line and the
audit ledger both read it."""

from __future__ import annotations

import pytest

from relay.core.interfaces import SmtpReply
from relay.core.queue_id import upstream_queue_id


@pytest.mark.parametrize(("reply", "queue_id"), [
    ("250 2.0.0 Ok: queued as 4Xb2Lk1Zz9z3", "4Xb2Lk1Zz9z3"),  # Postfix
    ("250 OK id=1tQk2A-0001Xy-3C", "1tQk2A-0001Xy-3C"),  # Exim
    ("250 2.0.0 3B1Kx2Ab012345 Message accepted for delivery", "3B1Kx2Ab012345"),  # Sendmail
    ("250 Ok 0100018c2f3a4b5c-1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d-000000",  # Amazon SES
     "0100018c2f3a4b5c-1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d-000000"),
    ("250 2.0.0 OK <AM0PR01MB1234.eurprd01.prod.outlook.com@x> [Hostname=AM0PR01MB1234]",
     "<AM0PR01MB1234.eurprd01.prod.outlook.com@x>"),  # Microsoft 365
    ("250 2.0.0 OK  1733100000 a1b2c3d4e5-4d.12 - gsmtp", "a1b2c3d4e5-4d.12"),  # Gmail
    ("250 2.0.0 Ok: stored in Maildir", ""),
    ("250 2.0.0 Ok (queued as 1733100000-4711-1)", "1733100000-4711-1"),  # Haraka
    ("250 2.0.0 Ok queue id 9F3C2A1B77", "9F3C2A1B77"),
    ("451 4.3.0 queued as NOTSENT", ""),  # not accepted: no queue id
])
def test_the_queue_id_of_common_smarthosts(reply: str, queue_id: str) -> None:
    code, text = reply.split(" ", 1)
    assert upstream_queue_id(SmtpReply.parse(int(code), text)) == queue_id
