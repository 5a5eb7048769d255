"""Key rules (relay.core.key_rules, relay.core.keys.derive_key): which rule matches, what key
and template it derives from the header section and the decoded text, and that no pattern and
message can make a rule take seconds."""

from __future__ import annotations

import re
import time
from email.message import EmailMessage

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.core.headers import DedupHeaders, parse_message
from relay.core.key_rules import (
    MAX_TEXT_CHARS,
    MessageView,
    build_rule,
    content_digest,
    first_match,
    html_text,
    normalized_text,
    subject_template,
)
from relay.core.keys import KeyRules, derive_key

NO_HEADERS = DedupHeaders(keys=(), templates=())


def mail(subject: str = "Your order #1042 has shipped", body: str = "Thanks for your order.",
         *, subtype: str = "plain", cte: str | None = None, extra: dict[str, str] | None = None
         ) -> bytes:
    msg = EmailMessage()
    msg["From"] = "shop@shop.example"
    msg["To"] = "jane@example.net"
    msg["Subject"] = subject
    for name, value in (extra or {}).items():
        msg[name] = value
    msg.set_content(body, subtype=subtype, charset="utf-8", cte=cte)
    return msg.as_bytes()


def view(content: bytes, mail_from: str = "shop@shop.example",
         rcpts: tuple[str, ...] = ("jane@example.net",)) -> MessageView:
    return MessageView(parse_message(content), mail_from=mail_from, rcpt_tos=rcpts)


def test_a_subject_rule_takes_its_first_group_and_its_fixed_template() -> None:
    rule = build_rule(name="orders", key=r"subject:order #(\d+)", sender="*@Shop.Example",
                      template="receipt")
    found = first_match([rule], view(mail()), max_key_chars=256)
    assert found is not None and (found.key, found.template) == ("1042", "receipt")


def test_every_given_match_must_hold_and_the_first_rule_wins() -> None:
    other_sender = build_rule(name="a", key="content", sender="*@bank.example")
    other_domain = build_rule(name="b", key="content", recipient_domain="example.com")
    no_header = build_rule(name="c", key="content", header="X-Order-Id")
    no_subject = build_rule(name="d", key="content", subject="^Invoice")
    fits = build_rule(name="e", key="header:Message-ID", recipient_domain="*.net")
    later = build_rule(name="f", key="content")
    content = mail(extra={"Message-ID": "<m1@host>"})
    found = first_match([other_sender, other_domain, no_header, no_subject, fits, later],
                        view(content), max_key_chars=256)
    assert found is not None and found.rule.name == "e" and found.key == "<m1@host>"


def test_a_body_rule_reads_the_decoded_text_of_each_encoding() -> None:
    rule = build_rule(name="b", key=r"body:Tracking n° (\w+)")
    for cte in ("quoted-printable", "base64", "8bit"):
        content = mail(body="Bonjour,\nTracking n° ZX99\n", cte=cte)
        found = first_match([rule], view(content), max_key_chars=256)
        assert found is not None and found.key == "ZX99", cte


def test_html_without_a_plain_part_is_read_without_its_tags() -> None:
    html = ("<html><style>p{}</style><p>Order <b>#77</b> &amp; more</p>"
            "<script>var n = 1;</script></html>")
    assert html_text(html).split() == ["Order", "#77", "&", "more"]
    rule = build_rule(name="h", key=r"body:Order #(\d+)")
    found = first_match([rule], view(mail(body=html, subtype="html")), max_key_chars=256)
    assert found is not None and found.key == "77"


def test_a_rule_whose_source_yields_nothing_is_a_miss() -> None:
    rule = build_rule(name="m", key=r"subject:Order #(\d+)")
    found = first_match([rule], view(mail(subject="Hello")), max_key_chars=256)
    assert found is not None and found.key is None
    derived = derive_key(parse_message(mail(subject="Hello")), NO_HEADERS,
                         KeyRules(key_rules=(rule,)), mail_from="a@b", rcpt_tos=["c@d"])
    assert derived.missed and derived.source == "rule:m" and derived.headers.key is None


def test_an_explicit_key_header_always_wins() -> None:
    rule = build_rule(name="m", key="content")
    headers = DedupHeaders(keys=("K-1",), templates=("welcome",))
    derived = derive_key(parse_message(mail()), headers, KeyRules(key_rules=(rule,)),
                         mail_from="a@b", rcpt_tos=["c@d"])
    assert derived.source == "header" and derived.headers is headers


def test_a_rule_without_a_template_keeps_the_messages_own() -> None:
    rule = build_rule(name="m", key=r"subject:#(\d+)", mode="shadow")
    headers = DedupHeaders(keys=(), templates=("shipping",))
    derived = derive_key(parse_message(mail()), headers, KeyRules(key_rules=(rule,)),
                         mail_from="a@b", rcpt_tos=["c@d"])
    assert derived.headers == DedupHeaders(keys=("1042",), templates=("shipping",))
    assert derived.shadow


def test_content_ignores_timestamps_tokens_and_query_strings() -> None:
    first = mail(body="Report of 2024-01-02 10:00:00 UTC\nRun 7f3c9a1e-1b2c-4d5e-8f90-a1b2c3d4e5f6"
                      "\nOpen https://app.example/r/5?utm=1&t=abcDEF123456ghiJKL789\n"
                      "token 3q2+7w8ZkLmN0pQrStUvWxYz01==\n", extra={"Date": "Tue, 2 Jan 2024"})
    second = mail(body="Report of 2024-03-09 23:59:01 UTC\nRun 0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
                       "\nOpen https://app.example/r/5?utm=2&t=zzzYYY987654xxxWWW321\n"
                       "token Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5==\n", extra={"Date": "Sat, 9 Mar 2024"})
    changed = mail(body="Report of 2024-03-09 23:59:01 UTC\n"
                        "Run 0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
                        "\nOpen https://app.example/r/6?utm=2\n")
    assert content_digest(view(first)) == content_digest(view(second))
    assert content_digest(view(first)) != content_digest(view(changed))


def test_ignore_patterns_are_removed_before_the_digest() -> None:
    rule = build_rule(name="c", key="content", ignore=[r"Ticket \d+"])
    one, two = mail(body="Ticket 41 closed"), mail(body="Ticket 42 closed")
    assert (first_match([rule], view(one), max_key_chars=256)
            == first_match([rule], view(two), max_key_chars=256))
    assert normalized_text("a  Ticket 9\n b", rule.ignore) == "a b"


def test_a_subject_template_masks_digits_and_hex_tokens() -> None:
    assert subject_template("Invoice 2024-118 ref 9f8e7d6c  ready") == "Invoice #-# ref # ready"
    rule = build_rule(name="t", key="content", template="subject")
    found = first_match([rule], view(mail()), max_key_chars=256)
    assert found is not None and found.template == "Your order ## has shipped"


def test_a_key_longer_than_allowed_becomes_its_digest() -> None:
    rule = build_rule(name="l", key="header:X-Ref")
    found = first_match([rule], view(mail(extra={"X-Ref": "r" * 300})), max_key_chars=256)
    assert found is not None and found.key is not None and found.key.startswith("sha256:")
    assert len(found.key) == 7 + 64


@pytest.mark.parametrize(("key", "words"), [
    ("subject:Order #\\d+", "needs a capture group"),
    ("body:(unclosed", "is not a valid pattern"),
    ("header:", "none of"),
    ("digest", "none of"),
])
def test_an_invalid_rule_is_refused_with_its_name(key: str, words: str) -> None:
    with pytest.raises(ValueError, match=words) as caught:
        build_rule(name="billing", key=key)
    assert "'billing'" in str(caught.value)


def test_a_backtracking_pattern_on_a_crafted_message_finishes_fast() -> None:
    """Nested quantifiers over a long run without the final character: exponential time for a
    backtracking engine without a limit; here a bounded text and a per-pattern time limit."""
    rules = [build_rule(name="redos", key=r"body:(x+x+)+y", subject=r"^(a|aa)+$"),
             build_rule(name="poly", key=r"body:(\d+)\D*(\d+)\D*(\d+)X")]
    content = mail(subject="a" * 60 + "b", body="x" * 200_000)
    digits = mail(body="1" * 200_000)
    started = time.perf_counter()
    assert first_match(rules[:1], view(content), max_key_chars=256) is None
    found = first_match(rules[1:], view(digits), max_key_chars=256)
    assert found is not None and found.key is None
    assert time.perf_counter() - started < 3.0
    assert len(view(digits).text) <= MAX_TEXT_CHARS


def _multipart(kind: str) -> bytes:
    """Messages whose body part is chosen by structure: alternative, mixed with an attachment
    first, related with a start part, html only inside mixed, latin-1, no text at all."""
    msg = EmailMessage()
    msg["Subject"] = "Structure"
    if kind == "alternative":
        msg.set_content("plain text of it")
        msg.add_alternative("<p>html of it</p>", subtype="html")
    elif kind == "attachment-first":
        msg.set_content("the body")
        msg.add_attachment("text attached first", filename="a.txt")
        parts = msg.get_payload()
        assert isinstance(parts, list)
        parts.reverse()
    elif kind == "related":
        msg.set_content("<p>root html</p>", subtype="html")
        msg.add_related("<p>not the root</p>", subtype="html", cid="<second@x>")
    elif kind == "html-in-mixed":
        msg.set_content("<div>only <b>html</b></div>", subtype="html")
        msg.add_attachment(b"\x00\x01", maintype="application", subtype="octet-stream")
    elif kind == "latin-1":
        msg.set_content("caf\u00e9 cr\u00e8me", charset="iso-8859-1", cte="quoted-printable")
    elif kind == "unknown-charset":
        msg.set_content("hello")
        msg.replace_header("Content-Type", 'text/plain; charset="x-no-such-charset"')
    elif kind == "no-text":
        msg.set_content(b"\x89PNG", maintype="image", subtype="png")
    elif kind in ("nested-after-a-large-attachment", "bare-lf"):
        msg.set_content("the nested plain text")
        msg.add_alternative("<p>the nested html</p>", subtype="html")
        msg.make_mixed()
        msg.add_attachment(bytes(range(256)) * 1024, maintype="application", subtype="pdf",
                           filename="receipt.pdf")
        parts = msg.get_payload()
        assert isinstance(parts, list)
        parts.reverse()
    content = msg.as_bytes()
    return content.replace(b"\r\n", b"\n") if kind == "bare-lf" else content.replace(
        b"\n", b"\r\n")


@pytest.mark.parametrize("kind", ["alternative", "attachment-first", "related", "html-in-mixed",
                                  "latin-1", "unknown-charset", "no-text",
                                  "nested-after-a-large-attachment", "bare-lf"])
def test_the_text_is_the_part_get_body_picks(kind: str) -> None:
    """The compat32 read picks and decodes the part ``EmailMessage.get_body(("plain",
    "html"))`` does (the reference, with ``email.policy.default``)."""
    import email
    import email.policy

    content = _multipart(kind)
    parsed = email.message_from_bytes(content, policy=email.policy.default)
    assert isinstance(parsed, EmailMessage)
    body = parsed.get_body(preferencelist=("plain", "html"))
    try:
        want = "" if body is None else body.get_content()
    except LookupError:
        want = ""
    if body is not None and body.get_content_subtype() == "html":
        want = html_text(want)
    assert view(content).text == want


QUERY = re.compile(r"(?<=[^\s?#\"'<>])[?#][^\s\"'<>]*")  # the query pattern as first written


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab?#= \t\"'<>/.&\n\u00e9", max_size=40))
def test_the_query_pattern_removes_what_its_first_form_did(text: str) -> None:
    assert normalized_text(text) == _normalized_with(QUERY, text)


def _normalized_with(query: re.Pattern[str], text: str) -> str:
    from relay.core import key_rules

    for volatile in (query, *key_rules._VOLATILE[1:]):
        text = volatile.sub(" ", text)
    return key_rules._BLANKS.sub(" ", text).strip()
