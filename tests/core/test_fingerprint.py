"""relay.core.fingerprint: header lookup, normalization and hashing (design.md §2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import encodings.aliases
import hashlib
import hmac

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.core.errors import InvalidAddressError, InvalidDedupKeyError
from relay.core.fingerprint import fingerprint, store_key
from relay.core.headers import (
    DedupHeaders,
    check_field_names,
    extract_dedup_headers,
    header_section_end,
    normalize_header_value,
    strip_fields,
)
from relay.core.recipients import ascii_address, normalize_recipient

SEED_HEX = "30c8e812a32d46b8971d68a9c547dce6f95a92a86987f0ad79879616407139b6"


def message(*header_lines: str | bytes, body: bytes = b"Hello\r\n") -> bytes:
    """A raw message: the header lines joined by CRLF, an empty line, then ``body``."""
    raw = [line.encode() if isinstance(line, str) else line for line in header_lines]
    return b"".join(line + b"\r\n" for line in raw) + b"\r\n" + body


def fp_of(content: bytes, rcpt: str = "user@example.net") -> str | None:
    """The fingerprint the relay would use for ``rcpt``, or None when there is no key."""
    headers = extract_dedup_headers(content)
    if headers.key is None:
        return None
    return fingerprint(normalize_recipient(rcpt), headers.template, headers.key)


# -- the seed formula -----------------------------------------------------------------------------


def test_seed_formula_is_sha256_of_lowered_trimmed_recipient_template_and_key() -> None:
    """A single ASCII key hashes exactly like the seed Go mailer: sha256(rcpt NUL tpl NUL key)."""
    fp = fingerprint(normalize_recipient("User@Example.com "), "welcome", "W-1")
    expected = hashlib.sha256(
        ("user@example.com" + "\0" + "welcome" + "\0" + "W-1").encode()
    ).hexdigest()
    assert fp == expected
    assert fp == SEED_HEX


def test_store_key_prefixes_the_fingerprint() -> None:
    """The store key is the prefix followed by the hex fingerprint."""
    assert store_key("email:fp:", SEED_HEX) == "email:fp:" + SEED_HEX


def test_hmac_fingerprint_differs_from_plain_and_is_deterministic() -> None:
    """With a secret the fingerprint is HMAC-SHA-256: stable, and unlike the plain digest."""
    first = fingerprint("user@example.com", "welcome", "W-1", secret=b"s3cret")
    again = fingerprint("user@example.com", "welcome", "W-1", secret=b"s3cret")
    expected = hmac.new(b"s3cret", b"user@example.com\0welcome\0W-1", hashlib.sha256).hexdigest()
    assert first == again == expected
    assert first != SEED_HEX
    assert first != fingerprint("user@example.com", "welcome", "W-1", secret=b"other")


def test_empty_hmac_secret_is_refused() -> None:
    """An empty secret raises ValueError instead of silently hashing with no key."""
    with pytest.raises(ValueError, match="secret"):
        fingerprint("user@example.com", "welcome", "W-1", secret=b"")


# -- header lookup and value normalization (RFC 5322 sections 1.2.2, 2.2.3; RFC 2047) ------------


def test_value_folded_onto_the_next_line_equals_the_unfolded_value() -> None:
    """Case 07: a key folded after the colon hashes like the same key on one line (A == B)."""
    key = "ORD-2024-000123-customer-00042-region-eu-west-channel-webshop-retry-0"
    folded = message("X-Template: order-confirmation", "X-Dedupe-Key:", f" {key}")
    single = message("X-Template: order-confirmation", f"X-Dedupe-Key: {key}")
    assert fp_of(folded, "buyer@example.net") == fp_of(single, "buyer@example.net")
    assert extract_dedup_headers(folded).key == key


def test_tab_fold_inside_a_value_equals_one_space() -> None:
    """Case 07: a value folded with CRLF TAB hashes like its one-line form (C == D)."""
    folded = message(
        "X-Template: order confirmation", "X-Dedupe-Key: order 123 for", "\tcustomer 42"
    )
    single = message("X-Template: order confirmation", "X-Dedupe-Key: order 123 for customer 42")
    assert fp_of(folded, "buyer@example.net") == fp_of(single, "buyer@example.net")
    assert extract_dedup_headers(folded).key == "order 123 for customer 42"


def test_every_occurrence_counts_as_a_sorted_set() -> None:
    """Case 09: {K-1, K-2} in either order match each other, K-1 twice matches K-1 once."""
    a = message("X-Template: digest", "X-Dedupe-Key: K-1", "X-Dedupe-Key: K-2")
    b = message("X-Template: digest", "X-Dedupe-Key: K-1")
    c = message("X-Template: digest", "X-Dedupe-Key: K-2", "X-Dedupe-Key: K-1")
    d = message("X-Template: digest", "X-Dedupe-Key: K-1", "X-Dedupe-Key: K-1")
    assert fp_of(a) == fp_of(c)
    assert fp_of(b) == fp_of(d)
    assert fp_of(a) != fp_of(b)
    assert extract_dedup_headers(a) == DedupHeaders(keys=("K-1", "K-2"), templates=("digest",))
    assert extract_dedup_headers(a).key == "K-1\x1fK-2"


def test_field_names_match_in_any_case() -> None:
    """Case 10: X-Dedupe-Key, x-dedupe-key and X-Dedupe-KEY are one field (A == B == C)."""
    a = message("X-Template: t-1", "X-Dedupe-Key: k-1")
    b = message("x-template: t-1", "x-dedupe-key: k-1")
    c = message("X-TEMPLATE: t-1", "X-Dedupe-KEY: k-1")
    assert fp_of(a) is not None
    assert fp_of(a) == fp_of(b) == fp_of(c)


def test_underscore_spelling_is_a_different_field() -> None:
    """Case 10: X-Dedupe_Key is not X-Dedupe-Key, so message D carries no key."""
    d = message("X-Template: t-1", "X-Dedupe_Key: k-1")
    assert extract_dedup_headers(d).key is None


def test_names_differing_only_in_case_are_two_occurrences() -> None:
    """Case 10: X-Dedupe-Key: k-1 and x-dedupe-key: k-2 give the key set {k-1, k-2}."""
    content = message("X-Dedupe-Key: k-1", "x-dedupe-key: k-2")
    assert extract_dedup_headers(content).keys == ("k-1", "k-2")


def test_surrounding_blanks_and_missing_space_do_not_change_the_key() -> None:
    """Case 11: trailing spaces, no space after the colon and TABs around the value all match."""
    variants = [
        "X-Dedupe-Key: K-77",
        "X-Dedupe-Key: K-77   ",
        "X-Dedupe-Key:K-77",
        "X-Dedupe-Key:\tK-77\t",
    ]
    fps = {fp_of(message("X-Template: statement", line)) for line in variants}
    assert len(fps) == 1
    assert None not in fps


def test_whitespace_only_key_means_no_key() -> None:
    """Case 11 E: a key of blanks only is empty after trimming, so the message has no key."""
    assert extract_dedup_headers(message("X-Template: statement", "X-Dedupe-Key:  ")).key is None


def test_inner_blank_runs_collapse_to_one_space() -> None:
    """Case 11: 'K 77' and 'K  77' match each other but not 'K-77'."""
    f = message("X-Template: statement", "X-Dedupe-Key: K 77")
    g = message("X-Template: statement", "X-Dedupe-Key: K  77")
    a = message("X-Template: statement", "X-Dedupe-Key: K-77")
    assert fp_of(f) == fp_of(g)
    assert fp_of(f) != fp_of(a)


def test_idempotency_key_is_an_alias_pooled_with_x_dedupe_key() -> None:
    """Idempotency-Key occurrences join the X-Dedupe-Key occurrences in one key set."""
    content = message("Idempotency-Key: K-2", "X-Dedupe-Key: K-1", "idempotency-key: K-1")
    assert extract_dedup_headers(content).keys == ("K-1", "K-2")
    alone = message("Idempotency-Key: K-1")
    assert fp_of(alone) == fp_of(message("X-Dedupe-Key: K-1"))


def test_configured_names_replace_the_defaults() -> None:
    """key_names and template_names choose the fields; the default names then do not count."""
    content = message("X-Job: j-1", "X-Dedupe-Key: ignored", "X-Kind: invoice")
    headers = extract_dedup_headers(content, key_names=["x-job"], template_names=["X-KIND"])
    assert headers == DedupHeaders(keys=("j-1",), templates=("invoice",))


def test_a_field_name_that_is_not_rfc5322_is_refused() -> None:
    """A configured field name with a colon or a space raises ValueError."""
    with pytest.raises(ValueError, match="field name"):
        extract_dedup_headers(b"", key_names=["X-Dedupe Key"])


def test_absent_template_is_the_empty_string() -> None:
    """Without X-Template the template part is "" and the key still counts."""
    headers = extract_dedup_headers(message("X-Dedupe-Key: K-1"))
    assert headers.template == ""
    assert headers.key == "K-1"


def test_blank_template_equals_absent_template() -> None:
    """An X-Template of blanks only counts as no template."""
    blank = message("X-Template:   ", "X-Dedupe-Key: K-1")
    absent = message("X-Dedupe-Key: K-1")
    assert extract_dedup_headers(blank) == extract_dedup_headers(absent)


def test_several_templates_are_a_sorted_set_joined_by_nul() -> None:
    """Distinct template values are sorted and joined by NUL like keys."""
    content = message("X-Template: b", "X-Template: a", "X-Template: b", "X-Dedupe-Key: K")
    assert extract_dedup_headers(content).template == "a\x1fb"


# -- header section boundaries --------------------------------------------------------------------


def test_body_lines_are_never_read_as_headers() -> None:
    """A body line that looks like X-Dedupe-Key does not change the key."""
    plain = message("X-Dedupe-Key: K-1")
    tricked = message("X-Dedupe-Key: K-1", body=b"X-Dedupe-Key: other\r\nX-Template: x\r\n")
    assert extract_dedup_headers(tricked) == extract_dedup_headers(plain)


def test_key_only_in_the_body_means_no_key() -> None:
    """A message whose only X-Dedupe-Key line follows the empty line has no key."""
    content = message("Subject: hi", body=b"X-Dedupe-Key: K-1\r\n")
    assert extract_dedup_headers(content).key is None


def test_message_starting_with_an_empty_line_has_no_header() -> None:
    """An empty first line ends the header section at once."""
    assert extract_dedup_headers(b"\r\nX-Dedupe-Key: K-1\r\n").key is None


def test_message_without_an_empty_line_is_all_header() -> None:
    """Without an empty line every line is header."""
    assert extract_dedup_headers(b"Subject: hi\r\nX-Dedupe-Key: K-1").key == "K-1"


def test_bare_lf_line_ends_are_accepted() -> None:
    """LF-only line ends split fields and end the header like CRLF."""
    content = b"X-Template: t\nX-Dedupe-Key: K-1\n\nX-Dedupe-Key: body\n"
    assert extract_dedup_headers(content) == DedupHeaders(keys=("K-1",), templates=("t",))


def test_a_first_mbox_from_line_is_skipped() -> None:
    """A first line 'From sender date' (an mbox envelope) is skipped; the fields after count."""
    content = message("From sender@example.com Mon Jan 1", "X-Dedupe-Key: K-1")
    assert extract_dedup_headers(content).key == "K-1"


MULTIPART_WITHOUT_SEPARATOR = (
    b"From: app@example.com\r\nX-Template: invoice\r\n"
    b"Content-Type: multipart/mixed; boundary=b1\r\n"
    b"--b1\r\nContent-Type: text/plain\r\nX-Dedupe-Key: part-key\r\n\r\n%s\r\n--b1--\r\n")


def test_a_body_starting_without_the_empty_line_is_not_header() -> None:
    """The first line that is no field ends the header: a MIME part's X-Dedupe-Key is body."""
    first = extract_dedup_headers(MULTIPART_WITHOUT_SEPARATOR % b"invoice 1")
    second = extract_dedup_headers(MULTIPART_WITHOUT_SEPARATOR % b"invoice 2")
    assert first == second == DedupHeaders(keys=(), templates=("invoice",))


@pytest.mark.parametrize("line", [b"no colon here", b":empty name", b"bad name: v",
                                  b"From sender@example.com Mon Jan 1", b"\xc3\xa9: v"])
def test_a_line_that_cannot_be_a_field_ends_the_header(line: bytes) -> None:
    """After the first line, a line that is no field and no continuation starts the body."""
    content = b"X-Template: t\r\n" + line + b"\r\nX-Dedupe-Key: K-1\r\n X-Template: u\r\n"
    assert extract_dedup_headers(content) == DedupHeaders(keys=(), templates=("t",))
    assert header_section_end(content) == len(b"X-Template: t\r\n")
    assert strip_fields(content, NAMES) == content[len(b"X-Template: t\r\n"):]


def test_a_first_line_that_cannot_be_a_field_leaves_no_header() -> None:
    """A message whose first line is no field and no mbox From line has no header section."""
    content = b"hello world\r\nX-Dedupe-Key: K-1\r\n\r\n"
    assert header_section_end(content) == 0
    assert extract_dedup_headers(content).key is None


def test_a_leading_continuation_line_does_not_end_the_header() -> None:
    """A first line starting with a blank is a stray continuation, skipped like Python's parser."""
    assert extract_dedup_headers(b" stray\r\nX-Dedupe-Key: K-1\r\n\r\nbody").key == "K-1"


def test_header_section_end_is_where_the_empty_line_starts() -> None:
    """The section ends where the empty line starts, for CRLF and bare LF line ends."""
    assert header_section_end(b"A: 1\r\n\r\nB: 2") == 6
    assert header_section_end(b"A: 1\n\nB: 2") == 5
    assert header_section_end(b"A: 1\r\n folded") == len(b"A: 1\r\n folded")


def test_blanks_before_the_colon_are_obsolete_syntax_for_the_same_field() -> None:
    """'X-Dedupe-Key : v' (RFC 5322 obs-optional) is the X-Dedupe-Key field."""
    assert extract_dedup_headers(message("X-Dedupe-Key : K-1")).key == "K-1"


# -- RFC 2047 -------------------------------------------------------------------------------------


def test_rfc2047_base64_word_is_decoded() -> None:
    """An upper-case =?UTF-8?B?...?= word decodes to its text."""
    content = message("X-Dedupe-Key: =?UTF-8?B?S8O2LTE=?=")
    assert extract_dedup_headers(content).key == "Kö-1"
    assert fp_of(content) == fp_of(message("X-Dedupe-Key: Kö-1"))


@pytest.mark.parametrize(("unpadded", "padded"), [
    ("=?UTF-8?B?S8O2LTE?=", "=?UTF-8?B?S8O2LTE=?="), ("=?utf-8?b?S8O2?=", "=?utf-8?b?S8O2?="),
    ("=?UTF-8?B?S8O2LQ?=", "=?UTF-8?B?S8O2LQ==?="),
])
def test_rfc2047_base64_word_without_padding_is_the_padded_word(unpadded: str,
                                                                padded: str) -> None:
    """A B word whose '=' padding is left out decodes to the same key as the padded one."""
    assert normalize_header_value(unpadded) == normalize_header_value(padded) != padded
    assert fp_of(message(f"X-Dedupe-Key: {unpadded}")) == fp_of(
        message(f"X-Dedupe-Key: {padded}"))


def test_rfc2047_base64_word_with_an_impossible_length_stays_literal() -> None:
    """A B word of 4n+1 characters is no base64 with or without padding: kept literal."""
    assert normalize_header_value("=?utf-8?b?S8O2L?=") == "=?utf-8?b?S8O2L?="


def test_rfc2047_q_word_in_lower_case_is_decoded() -> None:
    """A lower-case =?utf-8?q?...?= word decodes, with _ as a space."""
    content = message("X-Dedupe-Key: =?utf-8?q?K=C3=B6_1?=")
    assert extract_dedup_headers(content).key == "Kö 1"


def test_rfc2047_adjacent_words_are_joined_without_the_blank() -> None:
    """Blanks between two encoded-words are dropped (RFC 2047 section 6.2)."""
    content = message("X-Dedupe-Key: =?utf-8?q?order-?=  \t =?UTF-8?B?MTIz?=")
    assert extract_dedup_headers(content).key == "order-123"


def test_rfc2047_words_are_joined_as_bytes_before_decoding() -> None:
    """A UTF-8 character split across two encoded-words of one charset decodes whole."""
    content = message("X-Dedupe-Key: =?utf-8?q?K=C3?= =?UTF-8?q?=B6?=")
    assert extract_dedup_headers(content).key == "Kö"


def test_rfc2047_blank_between_encoded_word_and_text_is_kept() -> None:
    """The blank between an encoded-word and plain text stays (then collapses to one space)."""
    content = message("X-Dedupe-Key: order =?utf-8?q?123?=  done")
    assert extract_dedup_headers(content).key == "order 123 done"


@pytest.mark.parametrize(
    "word",
    [
        "=?utf-8?b?!!!?=",  # not base64
        "=?utf-8?q?a=ZZ?=",  # stray "="
        "=?x-no-such-charset?q?abc?=",  # unknown charset
        "=?base64?q?abc?=",  # a codec that is not a text encoding
        "=?utf-8?q?=FF?=",  # bytes that are not UTF-8
        "=?utf-7?q?+2AA-?=",  # decodes to a lone surrogate
        "x=?utf-8?q?abc?=",  # not a whole word (RFC 2047 section 5(1))
    ],
)
def test_rfc2047_malformed_or_undecodable_word_stays_literal(word: str) -> None:
    """An encoded-word that cannot be decoded is kept as the literal text."""
    assert extract_dedup_headers(message(f"X-Dedupe-Key: {word}")).key == word


def test_rfc2047_every_stdlib_codec_as_charset_decodes_or_stays_literal() -> None:
    """No charset name, however odd, makes extraction raise anything but InvalidDedupKeyError."""
    names = {*encodings.aliases.aliases, *encodings.aliases.aliases.values()}
    names |= {"__init__", "aliases", "undefined", "unicode_escape", "idna", "punycode"}
    for name in sorted(names):
        for text in ("B?3q2-7w==", "Q?=00=FF_=5C=5Cx", "Q?abc=5Cud800"):
            content = message(f"X-Dedupe-Key: =?{name}?{text}?=")
            with contextlib.suppress(InvalidDedupKeyError):
                extract_dedup_headers(content)


# -- 8-bit values: raw bytes hash as themselves -------------------------------------------------


def test_identical_latin1_bytes_give_the_same_fingerprint() -> None:
    """Case 06: a key holding a raw non-UTF-8 byte hashes the same on a byte-identical resend."""
    first = message(b"X-Template: rechnung", b"X-Dedupe-Key: R-2024-\xfc42")
    again = message(b"X-Template: rechnung", b"X-Dedupe-Key: R-2024-\xfc42")
    assert fp_of(first) is not None
    assert fp_of(first) == fp_of(again)


def test_a_different_latin1_byte_gives_another_fingerprint() -> None:
    """Case 06: keys differing in one raw 8-bit byte have different fingerprints."""
    first = message(b"X-Dedupe-Key: R-\xfc")
    other = message(b"X-Dedupe-Key: R-\xdf")
    utf8 = message("X-Dedupe-Key: R-ü")
    assert len({fp_of(first), fp_of(other), fp_of(utf8)}) == 3


# -- invalid keys and templates -------------------------------------------------------------------


def test_key_of_256_characters_is_accepted() -> None:
    """A key of exactly max_key_chars characters is valid."""
    assert extract_dedup_headers(message("X-Dedupe-Key: " + "k" * 256)).key == "k" * 256


def test_key_longer_than_256_characters_is_refused() -> None:
    """A key of 257 characters raises InvalidDedupKeyError."""
    with pytest.raises(InvalidDedupKeyError, match="257 characters"):
        extract_dedup_headers(message("X-Dedupe-Key: " + "k" * 257))


def test_key_length_is_counted_after_normalization() -> None:
    """Blanks trimmed and collapsed by normalization do not count toward the limit."""
    content = message("X-Dedupe-Key:    " + "k" * 128 + "    " + "k" * 127 + "   ")
    assert len(extract_dedup_headers(content).key or "") == 256


def test_max_key_chars_is_configurable() -> None:
    """max_key_chars sets the limit."""
    with pytest.raises(InvalidDedupKeyError):
        extract_dedup_headers(message("X-Dedupe-Key: abcd"), max_key_chars=3)


@pytest.mark.parametrize("bad", [b"\r", b"\x00", b"\x7f", "\u0085".encode()])
def test_key_holding_a_control_character_is_refused(bad: bytes) -> None:
    """A lone CR, NUL, DEL or a C1 control in a key raises InvalidDedupKeyError."""
    with pytest.raises(InvalidDedupKeyError, match="control character"):
        extract_dedup_headers(message(b"X-Dedupe-Key: K" + bad + b"1"))


def test_control_character_from_an_encoded_word_is_refused() -> None:
    """A CR smuggled inside an encoded-word raises InvalidDedupKeyError after decoding."""
    with pytest.raises(InvalidDedupKeyError, match="U\\+000D"):
        extract_dedup_headers(message("X-Dedupe-Key: =?utf-8?q?K=0D1?="))


def test_one_bad_occurrence_refuses_the_message() -> None:
    """A bad second occurrence raises even when the first one is fine."""
    with pytest.raises(InvalidDedupKeyError):
        extract_dedup_headers(message(b"X-Dedupe-Key: K-1", b"X-Dedupe-Key: K\x002"))


def test_template_holding_a_control_character_is_refused() -> None:
    """A NUL in X-Template raises InvalidDedupKeyError naming the template."""
    with pytest.raises(InvalidDedupKeyError, match="template"):
        extract_dedup_headers(message(b"X-Template: a\x00b", b"X-Dedupe-Key: K-1"))


def test_template_longer_than_the_limit_is_refused() -> None:
    """A template longer than max_key_chars raises InvalidDedupKeyError."""
    with pytest.raises(InvalidDedupKeyError, match="template"):
        extract_dedup_headers(message("X-Template: " + "t" * 257, "X-Dedupe-Key: K-1"))


def test_error_text_never_quotes_the_value() -> None:
    """The error message names the field and the reason, not the key itself."""
    with pytest.raises(InvalidDedupKeyError) as caught:
        extract_dedup_headers(message(b"X-Dedupe-Key: secret-value\x00"))
    assert "secret-value" not in str(caught.value)


def test_normalize_header_value_accepts_str() -> None:
    """normalize_header_value normalizes a typed str like a header value."""
    assert normalize_header_value("  order 123\r\n\tfor  =?utf-8?q?x?= ") == "order 123 for x"


# -- recipients (RFC 5321 sections 2.4, 4.1.2; RFC 5890; RFC 6531) -------------------------------


def test_local_part_is_lowercased_by_default() -> None:
    """Case 12: John.Doe@Example.COM, john.doe@example.com and JOHN.DOE@EXAMPLE.COM match."""
    forms = ["John.Doe@Example.COM", "john.doe@example.com", "JOHN.DOE@EXAMPLE.COM"]
    assert {normalize_recipient(form) for form in forms} == {"john.doe@example.com"}


def test_case_sensitive_local_parts_stay_distinct() -> None:
    """Case 12: with local_part_case_sensitive the three forms differ; the domain is lowered."""
    forms = ["John.Doe@Example.COM", "john.doe@example.com", "JOHN.DOE@EXAMPLE.COM"]
    normalized = [normalize_recipient(form, local_part_case_sensitive=True) for form in forms]
    assert normalized == ["John.Doe@example.com", "john.doe@example.com", "JOHN.DOE@example.com"]


@pytest.mark.parametrize("sensitive", [False, True])
@pytest.mark.parametrize("form", ["Postmaster", "<Postmaster>", "POSTMASTER", "postmaster"])
def test_postmaster_is_case_insensitive_in_every_policy(form: str, sensitive: bool) -> None:
    """Case 12: Postmaster in any case, with or without brackets, is postmaster."""
    assert normalize_recipient(form, local_part_case_sensitive=sensitive) == "postmaster"


@pytest.mark.parametrize("sensitive", [False, True])
def test_postmaster_with_a_domain_is_case_insensitive(sensitive: bool) -> None:
    """Postmaster@Example.COM is postmaster@example.com in every policy."""
    normalized = normalize_recipient("Postmaster@Example.COM", local_part_case_sensitive=sensitive)
    assert normalized == "postmaster@example.com"


def test_decomposed_local_part_equals_the_nfc_form() -> None:
    """Case 01: jörg (NFC) and jo + U+0308 + rg normalize to the same recipient."""
    assert normalize_recipient("jörg@example.com") == normalize_recipient("jo\u0308rg@example.com")
    assert normalize_recipient("jo\u0308rg@example.com") == "j\u00f6rg@example.com"


def test_non_ascii_local_part_is_lowercased_by_default() -> None:
    """Case 01: JÖRG@example.com matches jörg@example.com under the default policy."""
    assert normalize_recipient("JÖRG@example.com") == normalize_recipient("jörg@example.com")
    assert normalize_recipient("JÖRG@example.com", local_part_case_sensitive=True) == (
        "JÖRG@example.com"
    )


def test_idn_domain_becomes_its_lowercase_a_label() -> None:
    """user@Bücher.example and user@xn--bcher-kva.example are the same recipient."""
    assert normalize_recipient("user@Bücher.example") == "user@xn--bcher-kva.example"
    assert normalize_recipient("user@XN--BCHER-KVA.example") == "user@xn--bcher-kva.example"


def test_source_route_is_dropped() -> None:
    """<@a.example,@b.example:John@example.com> normalizes to john@example.com."""
    assert normalize_recipient("<@a.example,@b.example:John@example.com>") == "john@example.com"


def test_malformed_source_route_is_refused() -> None:
    """A source route without its colon raises InvalidAddressError."""
    with pytest.raises(InvalidAddressError, match="source route"):
        normalize_recipient("@a.example,john@example.com")


def test_redundant_quotes_are_removed() -> None:
    """ "john"@example.com is john@example.com."""
    assert normalize_recipient('"john"@example.com') == "john@example.com"
    assert normalize_recipient('"j\\ohn"@example.com') == "john@example.com"


def test_needed_quotes_are_kept_in_minimal_form() -> None:
    """A local part with a space stays quoted; only quote and backslash stay escaped."""
    assert normalize_recipient('"John\\ Doe"@example.com') == '"john doe"@example.com'
    assert normalize_recipient('"a\\"b"@example.com') == '"a\\"b"@example.com'


def test_angle_brackets_and_surrounding_spaces_are_dropped() -> None:
    """' <User@Example.com> ' normalizes to user@example.com."""
    assert normalize_recipient(" <User@Example.com> ") == "user@example.com"


@pytest.mark.parametrize("address", ["<user@example.net", "user@example.net>",
                                     "<<user@example.net>>", ">user@example.net<"])
def test_unbalanced_angle_brackets_are_refused(address: str) -> None:
    """A path whose angle brackets are not one pair around it is no address: refused."""
    with pytest.raises(InvalidAddressError, match="angle bracket"):
        normalize_recipient(address)


def test_address_literal_is_kept_and_lowercased() -> None:
    """An address-literal domain is not IDNA-encoded, only lowercased."""
    assert normalize_recipient("user@[192.0.2.1]") == "user@[192.0.2.1]"
    assert normalize_recipient("User@[IPv6:2001:DB8::1]") == "user@[ipv6:2001:db8::1]"


@pytest.mark.parametrize(
    "address",
    [
        "user\r@example.com",
        "user@example.com\n",
        "us\x00er@example.com",
        "user@exa\tmple.com",
        "user\x7f@example.com",
    ],
)
def test_control_character_in_address_is_refused(address: str) -> None:
    """CR, LF, NUL, TAB or DEL anywhere in an address raises InvalidAddressError."""
    with pytest.raises(InvalidAddressError, match="control character"):
        normalize_recipient(address)


def test_surrogate_escaped_address_is_invalid_utf8() -> None:
    """A raw non-UTF-8 byte (surrogate-escaped by the SMTP server) raises InvalidAddressError."""
    address = b"j\xf6rg@example.com".decode("utf-8", "surrogateescape")
    with pytest.raises(InvalidAddressError, match="UTF-8"):
        normalize_recipient(address)


@pytest.mark.parametrize(
    "address", ["user@my_host.example", "user@-bad.example", "user@a..example", "user@"]
)
def test_domain_idna_refuses_is_refused(address: str) -> None:
    """A domain that IDNA2008/UTS 46 refuses raises InvalidAddressError."""
    with pytest.raises(InvalidAddressError, match="IDNA"):
        normalize_recipient(address)


@pytest.mark.parametrize("address", ["", "  ", "<>", '"unterminated@example.com', "a@[1.2.3.4"])
def test_malformed_address_is_refused(address: str) -> None:
    """Empty addresses, an open quote or an open address literal raise InvalidAddressError."""
    with pytest.raises(InvalidAddressError):
        normalize_recipient(address)


def test_sender_is_not_part_of_the_fingerprint_inputs() -> None:
    """The fingerprint depends only on recipient, template and key (design.md §2)."""
    one = fingerprint(normalize_recipient("a@example.com"), "t", "k")
    two = fingerprint(normalize_recipient("b@example.com"), "t", "k")
    assert one != two
    assert one == fingerprint("a@example.com", "t", "k")


# -- properties -----------------------------------------------------------------------------------

_LOCAL_CHARS = st.characters(blacklist_categories=("Cc", "Cs"))
_DOMAINS = st.sampled_from(
    ["example.com", "EXAMPLE.org", "Bücher.example", "xn--bcher-kva.example", "[192.0.2.1]"]
)


@settings(deadline=None)
@given(
    local=st.text(_LOCAL_CHARS, min_size=1, max_size=20),
    domain=_DOMAINS,
    sensitive=st.booleans(),
)
def test_recipient_normalization_is_idempotent(local: str, domain: str, sensitive: bool) -> None:
    """Normalizing an already-normalized recipient gives it back unchanged."""
    try:
        once = normalize_recipient(f"{local}@{domain}", local_part_case_sensitive=sensitive)
    except InvalidAddressError:
        return
    assert normalize_recipient(once, local_part_case_sensitive=sensitive) == once


@settings(deadline=None)
@given(content=st.binary())
def test_arbitrary_bytes_raise_nothing_but_invalid_dedup_key(content: bytes) -> None:
    """Any byte string is either parsed or refused with InvalidDedupKeyError."""
    try:
        headers = extract_dedup_headers(content)
    except InvalidDedupKeyError:
        return
    assert headers.key is None or headers.keys


@settings(deadline=None)
@given(value=st.binary(max_size=300))
def test_arbitrary_key_bytes_raise_nothing_but_invalid_dedup_key(value: bytes) -> None:
    """Any bytes as an X-Dedupe-Key value are either normalized or refused."""
    content = b"X-Dedupe-Key:" + value + b"\r\n\r\nbody"
    try:
        headers = extract_dedup_headers(content)
    except InvalidDedupKeyError:
        return
    if headers.key is not None:
        fingerprint("user@example.com", headers.template, headers.key)


_WORD = st.text(
    st.characters(blacklist_categories=("Cc", "Cs", "Zs", "Zl", "Zp")), min_size=1, max_size=8
)


@settings(deadline=None)
@given(words=st.lists(_WORD, min_size=1, max_size=6), data=st.data())
def test_extra_blank_runs_normalize_equal(words: list[str], data: st.DataObject) -> None:
    """A value with runs of SP/HTAB between and around its words equals its single-spaced form."""
    blanks = st.text(st.sampled_from(" \t"), min_size=1, max_size=4)
    padded = data.draw(blanks) + "".join(word + data.draw(blanks) for word in words)
    assert normalize_header_value(padded) == normalize_header_value(" ".join(words))


def test_python_only_codecs_are_not_rfc2047_charsets() -> None:
    """An encoded-word in a Python-only codec (unicode_escape, idna) stays literal text."""
    escaped = extract_dedup_headers(b"X-Dedupe-Key: =?unicode_escape?q?=5Cu0041?=\r\n\r\n")
    plain = extract_dedup_headers(b"X-Dedupe-Key: =?utf-8?q?A?=\r\n\r\n")
    assert plain.key == "A"
    assert escaped.key == "=?unicode_escape?q?=5Cu0041?="


# -- field boundaries, root dots, literals, charsets --------------------------------------------


def test_template_and_key_sets_keep_their_boundary() -> None:
    """Templates {a, b} + key c and template a + keys {b, c} are different messages."""
    one = extract_dedup_headers(b"X-Template: a\r\nX-Template: b\r\nX-Dedupe-Key: c\r\n\r\n")
    two = extract_dedup_headers(b"X-Template: a\r\nX-Dedupe-Key: b\r\nX-Dedupe-Key: c\r\n\r\n")
    assert one.key is not None and two.key is not None
    assert (fingerprint("u@example.net", one.template, one.key)
            != fingerprint("u@example.net", two.template, two.key))


def test_single_values_still_hash_like_the_go_seed() -> None:
    """One template and one key: the seed's NUL-joined input, unchanged by the set separator."""
    headers = extract_dedup_headers(b"X-Template: welcome\r\nX-Dedupe-Key: W-1\r\n\r\n")
    assert headers.key == "W-1" and headers.template == "welcome"
    assert fingerprint("user@example.com", headers.template, headers.key) == hashlib.sha256(
        b"user@example.com\0welcome\0W-1").hexdigest()


@pytest.mark.parametrize("dot", [".", "\u3002", "\uff0e", "\uff61"])
def test_a_root_dot_in_any_spelling_is_refused(dot: str) -> None:
    """example.net. (or its ideographic/fullwidth full stop) is no second example.net."""
    with pytest.raises(InvalidAddressError):
        normalize_recipient(f"user@example.net{dot}")


def test_a_mid_domain_ideographic_full_stop_is_a_dot() -> None:
    """UTS 46 maps U+3002 to "." inside a domain: one mailbox, one fingerprint."""
    assert normalize_recipient("user@example\u3002net") == "user@example.net"


@pytest.mark.parametrize(("spelling", "canonical"), [
    ("u@[IPv6:2001:db8:0:0:0:0:0:1]", "u@[ipv6:2001:db8::1]"),
    ("u@[IPv6:2001:DB8::1]", "u@[ipv6:2001:db8::1]"),
    ("u@[ipv6:0:0:0:0:0:0:0:1]", "u@[ipv6:::1]"),
    ("u@[192.0.2.1]", "u@[192.0.2.1]"),
    ("u@[X-Tag:Stuff]", "u@[x-tag:stuff]"),
])
def test_address_literals_have_one_spelling(spelling: str, canonical: str) -> None:
    """IP literals are written canonically (RFC 5952 for IPv6), so spellings share one key."""
    assert normalize_recipient(spelling) == canonical


def test_charset_aliases_join_into_one_run() -> None:
    """utf-8 and utf8 name one charset: split bytes of one character join across the words."""
    assert normalize_header_value("=?utf-8?q?caf=C3?= =?utf8?q?=A9?=") == "café"


def test_empty_encoded_word_is_empty() -> None:
    """=?utf-8?q??= (CPython's folder writes it) decodes to nothing, not to itself."""
    assert normalize_header_value("=?utf-8?q??=\r\n =?utf-8?q?=C3=B1?=") == "ñ"
    assert normalize_header_value("=?utf-8?b??=") == ""


# -- strip_fields: the strip_dedupe_headers option ----------------------------------------------

NAMES = ("X-Dedupe-Key", "Idempotency-Key", "X-Template")


@pytest.mark.parametrize(("content", "stripped"), [
    (b"A: 1\r\nX-Dedupe-Key: k\r\n  more\r\nB: 2\r\n\r\nX-Dedupe-Key: body\r\n",
     b"A: 1\r\nB: 2\r\n\r\nX-Dedupe-Key: body\r\n"),
    (b"\r\nX-Dedupe-Key: k\r\n", b"\r\nX-Dedupe-Key: k\r\n"),  # no header section at all
    (b"X-Template : t\r\nA: 1", b"A: 1"),  # blank before the colon, no body
    (b"junk line\r\n continued\r\nX-Dedupe-Key: k\r\n\r\n",
     b"junk line\r\n continued\r\nX-Dedupe-Key: k\r\n\r\n"),  # a body without the empty line
    (b"A: 1\r\nX-Dedupe-Key: k\r\n--b\r\nX-Dedupe-Key: part\r\n",
     b"A: 1\r\n--b\r\nX-Dedupe-Key: part\r\n"),  # the part's field is body
])
def test_strip_fields_cases(content: bytes, stripped: bytes) -> None:
    """Only named fields of the header section leave, with their continuation lines."""
    assert strip_fields(content, NAMES) == stripped


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([b"X-Dedupe-Key: k1", b"x-template: t", b" folded",
                                 b"\tfolded", b"Subject: s", b"Idempotency-Key: i",
                                 b"junk", b""]), max_size=12),
       st.binary(max_size=40))
def test_nothing_is_read_from_a_stripped_message(lines: list[bytes], body: bytes) -> None:
    """What is stripped is exactly what is read: afterwards no key and no template remain,
    and every byte after the header section is unchanged."""
    content = b"\r\n".join(lines) + b"\r\n\r\n" + body
    out = strip_fields(content, NAMES)
    headers = extract_dedup_headers(out.replace(b"\x00", b""))
    assert headers.keys == () and headers.templates == ()
    assert out.endswith(b"\r\n\r\n" + body) or out.endswith(body)


_HEADER_LINES = st.lists(st.sampled_from([b"X-Dedupe-Key: k1", b"x-template: t", b" folded",
                                          b"Subject: s", b"Idempotency-Key: i"]), max_size=8)
# A line that cannot be a field, neither empty nor starting with a blank: no colon, a blank
# inside the name or a non-ASCII byte in it, or a colon first.
_NON_FIELD = st.one_of(
    st.from_regex(rb"\A[A-Za-z0-9\-][A-Za-z0-9\- ]{0,12}\Z"),
    st.from_regex(rb"\A[A-Za-z\-]{0,6}(?:[\x80-\xff]|[A-Za-z] [A-Za-z])[A-Za-z\-]{0,6}"
                  rb":[ -~]{0,6}\Z"),
    st.from_regex(rb"\A:[ -~]{0,8}\Z"),
)


@settings(max_examples=300, deadline=None)
@given(_HEADER_LINES, _NON_FIELD, st.lists(st.sampled_from(
    [b"X-Dedupe-Key: body", b"X-Template: body", b" folded", b"", b"--b"]), max_size=6))
def test_nothing_after_the_first_non_field_line_is_header(
        head: list[bytes], stop: bytes, rest: list[bytes]) -> None:
    """Whatever follows the first non-field line changes neither the key nor what is stripped."""
    prefix = b"".join(line + b"\r\n" for line in head) if head else b"Subject: s\r\n"
    tail = stop + b"\r\n" + b"\r\n".join(rest)
    assert extract_dedup_headers(prefix + tail) == extract_dedup_headers(prefix + b"\r\n")
    assert header_section_end(prefix + tail) == len(prefix)
    assert strip_fields(prefix + tail, NAMES).endswith(tail)


# -- pinned by mutation testing (tools/mutate.py) ------------------------------


def test_check_field_names_refuses_what_cannot_be_a_field_name() -> None:
    """check_field_names (the settings' start-up check) refuses non-ASCII, blanks and colons."""
    check_field_names(("X-Dedupe-Key", "Idempotency-Key"))
    for bad in ("X-Clé", "X Key", "X-Key:", ""):
        with pytest.raises(ValueError, match="not an RFC 5322 header field name"):
            check_field_names(("X-Template", bad))


def test_a_leading_continuation_line_is_kept_by_strip_fields() -> None:
    """A stray continuation before the first field belongs to no field and is not stripped."""
    assert strip_fields(b" stray\r\nX-Dedupe-Key: k\r\nA: 1\r\n\r\nb", NAMES) == (
        b" stray\r\nA: 1\r\n\r\nb")


def test_dedup_headers_are_immutable() -> None:
    """DedupHeaders is frozen: the key read from a message cannot be changed afterwards."""
    headers = extract_dedup_headers(message("X-Dedupe-Key: K-1"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        headers.keys = ("other",)  # type: ignore[misc]


@pytest.mark.parametrize(("address", "ascii_form"), [
    ("", ""), ("user@example.net", "user@example.net"),
    ("user@bücher.example", "user@xn--bcher-kva.example"),
])
def test_ascii_address_gives_the_a_label_form(address: str, ascii_form: str) -> None:
    """A non-ASCII domain becomes its A-label for a hop without SMTPUTF8; ASCII stays as is."""
    assert ascii_address(address) == ascii_form


@pytest.mark.parametrize("address", ["üser@example.net", "bücher", "üser@bücher.example"])
def test_ascii_address_refuses_a_non_ascii_local_part(address: str) -> None:
    """A non-ASCII local part (or a non-ASCII path without "@") has no ASCII form."""
    with pytest.raises(InvalidAddressError, match="no SMTPUTF8 downgrade"):
        ascii_address(address)


def test_a_value_folded_over_three_lines_keeps_every_piece() -> None:
    """Every continuation line of a field belongs to it, not only the first."""
    content = message("X-Dedupe-Key: a", " b", "\tc", "X-Template: t")
    assert extract_dedup_headers(content) == DedupHeaders(keys=("a b c",), templates=("t",))


def test_strip_fields_keeps_the_continuation_of_a_field_it_keeps() -> None:
    """A kept field keeps its continuation lines; a stripped one loses them."""
    content = b"Subject: a\r\n b\r\nX-Template: t\r\n u\r\n\r\nbody"
    assert strip_fields(content, NAMES) == b"Subject: a\r\n b\r\n\r\nbody"


@pytest.mark.parametrize(("value", "decoded"), [
    ("=?utf-8?q?a?= =?iso-8859-1?q?=E9?=", "a\u00e9"),  # two charsets: two runs, no blank
    ("=?utf-8?q?a?= =?utf-8?q?b?= =?utf-8?q?c?=", "abc"),  # one run of three words
    ("=?x-unknown?q?a?= =?utf-8?q?b?=", "=?x-unknown?q?a?= b"),  # literal run keeps its blank
    ("=?utf-8?q?b?= =?x-unknown?q?a?=", "b =?x-unknown?q?a?="),
    ("=?utf-8?q?a?= =?utf-8?q?b?= =?iso-8859-1?q?=E9?=", "ab\u00e9"),  # the run ends at word 3
    ("=?x-unknown?q?a?= =?x-unknown?q?b?= =?utf-8?q?c?=",
     "=?x-unknown?q?a?= =?x-unknown?q?b?= c"),  # a literal run of two words, then one decoded
])
def test_rfc2047_runs_split_at_a_charset_change(value: str, decoded: str) -> None:
    """Adjacent words join only within one charset; a run left literal keeps the blank."""
    assert normalize_header_value(value) == decoded


def test_a_quoted_local_part_ending_in_a_backslash_is_refused() -> None:
    """'"ab\\' (a quoted-pair with nothing to quote) is an InvalidAddressError, not a crash."""
    with pytest.raises(InvalidAddressError, match="backslash"):
        normalize_recipient('"ab\\')


def test_strip_fields_drops_a_tab_continuation_of_a_stripped_field() -> None:
    """A continuation starting with HTAB belongs to the field above it, stripped with it."""
    assert strip_fields(b"X-Template: t\r\n\tu\r\nA: 1\r\n\r\n", NAMES) == b"A: 1\r\n\r\n"


def test_refusal_texts_name_the_kind_not_the_value() -> None:
    """A control character is named by its code point, an IDNA refusal by its error class."""
    with pytest.raises(InvalidAddressError, match=r"control character U\+0007$"):
        normalize_recipient("us\x07er@example.net")
    with pytest.raises(InvalidAddressError, match=r"not a valid IDNA name \(\w+\)$"):
        normalize_recipient("user@ex_ample.net")
