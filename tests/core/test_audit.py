"""The audit ledger's rows of one message (relay/core/audit.py): the smarthost's queue id read
off its reply to the final dot, the Message-ID, one row per distinct recipient."""

from __future__ import annotations

from relay.core.audit import entries_for
from relay.core.headers import parse_message
from relay.core.interfaces import Outcome, RcptResult, RcptStatus, SmtpReply


def test_message_id_reads_the_header_section_only() -> None:
    """Folded value unfolded; a Message-ID line in the body is not the message's."""
    content = (b"From: a@x\r\nMessage-ID:\r\n <abc@x.example>\r\nSubject: s\r\n\r\n"
               b"Message-ID: <body@x>\r\n")
    assert parse_message(content).message_id == "<abc@x.example>"
    assert parse_message(b"Subject: s\r\n\r\nMessage-ID: <body@x>\r\n").message_id == ""


def test_one_row_per_distinct_recipient_with_its_reply() -> None:
    """A recipient named twice is one row; the queue id goes only to accepted recipients."""
    accepted = SmtpReply.parse(250, "2.0.0 Ok: queued as Q1")
    refused = SmtpReply.parse(550, "5.1.1 unknown user")
    rows = entries_for(
        now=1.0, rcpt_tos=["a@x", "b@x", "a@x"],
        outcomes={"a@x": Outcome.RELAYED, "b@x": Outcome.REFUSED_PERM},
        keys={"a@x": "fp:a", "b@x": "fp:b"}, template="t", dedupe_key="k",
        rcpt_results={"a@x": RcptResult(RcptStatus.ACCEPTED, accepted),
                      "b@x": RcptResult(RcptStatus.REFUSED, refused)}, final_reply=accepted,
        client_reply=SmtpReply(250, "2.0.0", "Ok"), upstream="smarthost",
        message_id="<m@x>", queue_id="qid")
    assert [(r.recipient, r.outcome, r.reply, r.upstream_queue_id) for r in rows] == [
        ("a@x", "relayed", "250 2.0.0 Ok: queued as Q1", "Q1"),
        ("b@x", "refused_perm", "550 5.1.1 unknown user", "")]
    assert {r.message_id for r in rows} == {"<m@x>"}
    assert {r.client_reply for r in rows} == {"250 2.0.0 Ok"}


def test_a_recipient_of_a_further_transaction_has_its_own_queue_id() -> None:
    """Past the smarthost's recipient limit, recipients went in a second transaction: each row
    names the queue id of the transaction that accepted it."""
    first = SmtpReply.parse(250, "2.0.0 Ok: queued as Q1")
    second = SmtpReply.parse(250, "2.0.0 Ok: queued as Q2")
    rows = entries_for(
        now=1.0, rcpt_tos=["a@x", "b@x"],
        outcomes={"a@x": Outcome.RELAYED, "b@x": Outcome.RELAYED},
        keys={"a@x": "fp:a", "b@x": "fp:b"}, template="t", dedupe_key="k",
        rcpt_results={"a@x": RcptResult(RcptStatus.ACCEPTED, first),
                      "b@x": RcptResult(RcptStatus.ACCEPTED, second)}, final_reply=first,
        client_reply=SmtpReply(250, "2.0.0", "Ok"), upstream="smarthost",
        message_id="<m@x>", queue_id="qid")
    assert [(r.recipient, r.upstream_queue_id) for r in rows] == [("a@x", "Q1"), ("b@x", "Q2")]


def test_masking_hides_a_one_character_or_quoted_local_part() -> None:
    """``j***@`` shows one character of a longer local part; one of a single character, or a
    quoted one, is hidden whole (its first character would be all of it, or a quote)."""
    from relay.core.address import mask_address

    assert mask_address("john.doe@example.com") == "j***@example.com"
    assert mask_address("J@example.com") == "***@example.com"
    assert mask_address('"john doe"@example.com') == "***@example.com"
