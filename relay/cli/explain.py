"""``dedup-relay explain [--config FILE] MESSAGE.eml [--rcpt ADDR ...]``: what the relay would
derive for a saved message (docs/fingerprints.md): whether its key header or which
``[[key_rule]]`` gives its key, the template and key, and each recipient's store key, computed
by :func:`relay.core.keys.derive_key` and :func:`relay.core.keys.recipient_key` as the relay
computes them. Opens no store. Exit codes: 0 explained, 2 the file cannot be read or the
message's key or a recipient is refused, 78 invalid configuration."""

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
    ``key`` and ``store_keys`` (recipient -> store key; the To, Cc and Bcc addresses when
    ``rcpts`` is empty), ``sender`` (``mail_from``, else Return-Path, else From). Raises
    :class:`InvalidDedupKeyError` and :class:`InvalidAddressError` as the relay refuses."""
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
    store_keys = {} if key is None or not p.dedup else {
        rcpt: recipient_key(rcpt, derived.headers.template, key, p).key for rcpt in recipients}
    return {"sender": sender, "source": _source(derived), "template": derived.headers.template,
            "key": key, "store_keys": store_keys}


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
        for name in ("sender", "source", "template", "key"):
            value = found[name]
            click.echo(f"{name}: {shown(str(value)) if value is not None else '(none)'}")
        store_keys = found["store_keys"]
        assert isinstance(store_keys, dict)
        for rcpt, store_key in store_keys.items():
            click.echo(f"store key of {shown(rcpt)}: {store_key}")
