"""``dedup-relay explain [--config FILE] MESSAGE.eml [--rcpt ADDR ...]``: what the relay would
derive for a saved message (docs/fingerprints.md): whether its key header or which
``[[key_rule]]`` gives its key, the template and key, the content digest its records keep, and
each recipient's store key (and, while a previous fingerprint secret is set, its store key
under that secret), computed by :func:`relay.core.keys.derive_key` and
:func:`relay.core.keys.recipient_key` as the relay computes them. Opens no store. Exit codes:
0 explained, 2 the file cannot be read or the message's key or a recipient is refused, 78
invalid configuration."""

from __future__ import annotations

import json
from email.utils import getaddresses
from pathlib import Path

import click

from relay.cli.exit_codes import ExitCode, epilog
from relay.cli.options import config_option, fail, load
from relay.cli.terminal import shown
from relay.core.errors import ConfigError, InvalidAddressError, InvalidDedupKeyError
from relay.core.headers import ParsedMessage, parse_message
from relay.core.keys import DerivedKey, derive_key, recipient_key
from relay.core.policy import Policy
from relay.settings import AdminSettings


def _addresses(message: ParsedMessage, *names: str) -> list[str]:
    """The addresses of the ``names`` fields of ``message`` (first occurrence each)."""
    values = [value for name in names if (value := message.first(name))]
    return [address for _, address in getaddresses(values) if address]


def _source(derived: DerivedKey) -> str:
    """Where the key comes from, in words."""
    if derived.rule is None:
        return derived.source or "none: no key header and no key rule matched (relayed " \
                                 "without dedup)"
    if derived.missed:
        return f"{derived.source}: matched, its key source yielded nothing (a miss: relayed " \
               "without dedup, counted in relay_key_rule_misses_total)"
    return f"{derived.source} (mode {derived.rule.mode})"


def explained(content: bytes, policy: Policy, *, rcpts: tuple[str, ...],
              mail_from: str | None) -> dict[str, object]:
    """What the relay derives for ``content`` under ``policy``: ``source``, ``template``,
    ``key``, ``content_digest`` (what its records keep, design.md §2.2; None without a key)
    and ``store_keys`` (recipient -> store key; the To, Cc and Bcc addresses when ``rcpts``
    is empty), with ``policy.previous_secret`` also ``previous_store_keys`` (recipient -> its
    store key under that secret), ``sender`` (``mail_from``, else Return-Path, else From).
    Raises :class:`InvalidDedupKeyError` and :class:`InvalidAddressError` as the relay
    refuses."""
    message = parse_message(content)
    sender = mail_from if mail_from is not None else next(
        iter(_addresses(message, "return-path") or _addresses(message, "from")), "")
    recipients = rcpts or tuple(_addresses(message, "to", "cc", "bcc"))
    headers = message.dedup_headers(key_names=policy.key_names,
                                    template_names=policy.template_names,
                                    max_key_chars=policy.max_key_chars)
    derived = derive_key(message, headers, policy, mail_from=sender, rcpt_tos=recipients)
    key = derived.headers.key
    p = policy.for_templates(derived.headers.templates)
    found = {} if key is None or not p.dedup else {
        rcpt: recipient_key(rcpt, derived.headers.template, key, p) for rcpt in recipients}
    explanation: dict[str, object] = {
        "sender": sender, "source": _source(derived), "template": derived.headers.template,
        "key": key, "content_digest": derived.content_digest() if found else None,
        "store_keys": {rcpt: each.key for rcpt, each in found.items()}}
    if policy.previous_secret is not None:
        explanation["previous_store_keys"] = {rcpt: each.previous
                                              for rcpt, each in found.items()}
    return explanation


def register(main: click.Group) -> None:
    """Add ``explain`` to the ``dedup-relay`` group."""

    @main.command("explain", epilog=epilog())
    @config_option
    @click.argument("message", type=click.Path(dir_okay=False, path_type=Path))
    @click.option("--rcpt", "rcpts", multiple=True, metavar="ADDR",
                  help="envelope recipient (repeatable) [default: the To, Cc and Bcc "
                       "addresses]")
    @click.option("--from", "mail_from", default=None, metavar="ADDR",
                  help="envelope sender [default: Return-Path, else From]")
    @click.option("--json", "as_json", is_flag=True, help="one JSON object")
    def explain_command(config_file: Path | None, message: Path, rcpts: tuple[str, ...],
                        mail_from: str | None, as_json: bool) -> None:
        """Print where the relay would take a saved message's key from (its key header, or
        the [[key_rule]] that matches), its template and key, and each recipient's store
        key."""
        settings = load(config_file, {}, base=AdminSettings)
        try:
            content = message.read_bytes()
        except OSError as exc:
            fail(ExitCode.USAGE, f"cannot read {message}: {exc.strerror or exc}")
        try:
            found = explained(content, settings.dedup_policy(), rcpts=rcpts,
                              mail_from=mail_from)
        except ConfigError as exc:
            fail(ExitCode.CONFIG, f"invalid configuration:\n{exc}")
        except (InvalidDedupKeyError, InvalidAddressError) as exc:
            fail(ExitCode.USAGE, f"the relay refuses this message: {exc}")
        if as_json:
            click.echo(json.dumps(found))
            return
        for name in ("sender", "source", "template", "key", "content_digest"):
            value = found[name]
            label = name.replace("_", " ")
            click.echo(f"{label}: {shown(str(value)) if value is not None else '(none)'}")
        for field, words in (("store_keys", "store key"),
                             ("previous_store_keys", "previous secret's store key")):
            keys = found.get(field, {})
            assert isinstance(keys, dict)
            for rcpt, store_key in keys.items():
                click.echo(f"{words} of {shown(rcpt)}: {store_key}")
