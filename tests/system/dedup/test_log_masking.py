"""Addresses in the relay's log lines are masked unless `log_recipients`: recipients quoted
inside an upstream's reply too, and two recipients whose masks are alike keep one entry each
in the decision line (real `serve` processes, the sink in the test's loop)."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from pathlib import Path

import pytest

from relay.core.address import mask_address
from relay.smtp.handler import distinct_labels
from tests.support.clients import message, send
from tests.support.relays import ServeProcess, start_serve
from tests.support.sink import Sink
from tests.support.waiting import until

GREYLISTED = "450 4.2.0 <jane.roe@example.net>: greylisted, try again later"


async def _serve(tmp_path: Path, sink: Sink, *flags: str) -> ServeProcess:
    return await start_serve(tmp_path, "--upstream", f"127.0.0.1:{sink.port}", "--store",
                             f"sqlite:///{tmp_path / 'dedup.db'}", "--metrics-listen", "off",
                             *flags, workers=1)


async def _decided(relay: ServeProcess) -> dict[str, object]:
    await until(lambda: any(e.get("message") == "message" for e in relay.lines()),
                within_s=10, what="the decision line")
    return next(e for e in relay.lines() if e.get("message") == "message")


async def test_an_address_quoted_in_the_upstream_s_reply_is_masked_in_every_line(
        tmp_path: Path, sink: Sink) -> None:
    """A refusal whose text names the recipient: no log line holds the full address; the
    decision line's reply and upstream texts hold its mask."""
    sink.handler.rcpt_plan["jane.roe@example.net"] = deque([GREYLISTED])
    relay = await _serve(tmp_path, sink)
    try:
        reply = await send(relay.port, ["jane.roe@example.net"], message())
        assert reply.code == 450, reply
        line = await _decided(relay)
    finally:
        await asyncio.to_thread(relay.stop)
    text = relay.log_path.read_text()
    assert "jane.roe@example.net" not in text
    assert "<j***@example.net>: greylisted" in str(line["reply"])


async def test_with_log_recipients_the_reply_keeps_the_address(
        tmp_path: Path, sink: Sink) -> None:
    """`--log-recipients`: the decision line shows the recipient and the reply as they are."""
    sink.handler.rcpt_plan["jane.roe@example.net"] = deque([GREYLISTED])
    relay = await _serve(tmp_path, sink, "--log-recipients")
    try:
        assert (await send(relay.port, ["jane.roe@example.net"], message())).code == 450
        line = await _decided(relay)
    finally:
        await asyncio.to_thread(relay.stop)
    assert "<jane.roe@example.net>: greylisted" in str(line["reply"])
    assert "jane.roe@example.net" in json.dumps(line["outcomes"])


async def test_recipients_with_alike_masks_keep_one_entry_each(
        tmp_path: Path, sink: Sink) -> None:
    """john@ and jane@ of one domain both mask to j***@: the decision line has an outcome and
    a key for each (j***@d and j***@d#2)."""
    relay = await _serve(tmp_path, sink)
    try:
        reply = await send(relay.port, ["john@example.net", "jane@example.net"], message())
        assert reply.code == 250, reply
        line = await _decided(relay)
    finally:
        await asyncio.to_thread(relay.stop)
    outcomes, keys = line["outcomes"], line["keys"]
    assert isinstance(outcomes, dict) and isinstance(keys, dict)
    assert set(outcomes) == set(keys) == {"j***@example.net", "j***@example.net#2"}
    assert len(set(keys.values())) == 2


@pytest.mark.parametrize(("recipients", "labels"), [
    (["john@d", "jane@d", "jim@d"], ["j***@d", "j***@d#2", "j***@d#3"]),
    (["john@d", "john@d", "mary@d"], ["j***@d", "m***@d"]),
    (["a@d", "j***@d#2", "jx@d", "jy@d"], ["***@d", "j***@d#2", "j***@d", "j***@d#3"]),
])
def test_each_recipient_gets_a_label_of_its_own(recipients: list[str],
                                               labels: list[str]) -> None:
    """Labels are the masks, numbered from #2 where an earlier one is the same; a recipient
    named twice keeps its one label."""
    got = distinct_labels(recipients, mask_address)
    assert list(got.values()) == labels
