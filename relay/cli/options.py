"""Command-line flags generated from :class:`relay.settings.Settings`: one per field.

The flag of field ``store_timeout`` is ``--store-timeout`` (a bool's is ``--scope-by-auth /
--no-scope-by-auth``), its help is the field's description followed by its default and its env
var. Values reach the settings as given, so a flag, its env var and its file key are checked
by the same validators and an invalid one is named the same way (exit 78, EX_CONFIG).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, get_origin

import click
from pydantic import SecretStr
from pydantic.fields import FieldInfo

from relay.cli.exit_codes import ExitCode
from relay.cli.terminal import shown_lines
from relay.core.errors import ConfigError
from relay.settings import (
    COMPUTED_DEFAULTS,
    FILE_ONLY_SETTINGS,
    SECTIONS,
    Settings,
    choices,
    env_name,
    flag_name,
    load_settings,
    plain_annotation,
    redact_url,
    section_fields,
    shown_value,
    unknown_env_vars,
)

# the field that opens each part of `serve --help`: a section's first (relay.settings.SECTIONS)
_SECTIONS = {section_fields(section)[0]: section.TITLE for section in SECTIONS}
# list settings whose flag may be repeated (``--upstream a --upstream b``), each value also a
# comma-separated list; the values reach the settings joined by commas
_REPEATABLE = frozenset({"upstream"})


def fail(code: ExitCode, message: str) -> NoReturn:
    """Print ``dedup-relay: message`` on stderr (control characters escaped, line breaks
    kept: :func:`relay.cli.terminal.shown_lines`) and exit with ``code``."""
    click.echo(f"dedup-relay: {shown_lines(message)}", err=True)
    sys.exit(int(code))


def load(config_file: Path | None, flags: dict[str, Any], *,
         base: type[Settings] = Settings) -> Settings:
    """The settings from ``flags`` (field name -> value or None), env vars and the file;
    exits :attr:`ExitCode.CONFIG` with one line per problem when they are invalid.

    A ``RELAY_*`` env var that is no setting is warned about on stderr (a typo is otherwise
    silently ignored).
    """
    for name in unknown_env_vars(os.environ):
        click.echo(f"dedup-relay: warning: {name} is not a setting and is ignored", err=True)
    try:
        return load_settings(flags, config_file, base=base)
    except ConfigError as exc:
        fail(ExitCode.CONFIG, f"invalid configuration:\n{exc}")


# the settings whose value is a secret itself (a flag's value is in every user's `ps`)
_SECRET_FLAGS = frozenset(flag_name(name) for name, field in Settings.model_fields.items()
                          if plain_annotation(field.annotation) is SecretStr)


def scrubbed_argv(argv: Sequence[str]) -> list[str] | None:
    """``argv`` with the value of each secret flag (``--upstream-password``,
    ``--fingerprint-secret``; as ``--flag VALUE`` or ``--flag=VALUE``) as ``***`` and the
    password of each URL (``--store redis://:PASSWORD@host``) redacted (:func:`redact_url`);
    None when there is nothing to hide."""
    scrubbed, hide_next = [], False
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if hide_next:
            arg = "***"
        elif eq and flag in _SECRET_FLAGS:
            arg = f"{flag}=***"
        elif "://" in arg:
            arg = f"{flag}={redact_url(value)}" if eq and flag.startswith("--") \
                else redact_url(arg)
        hide_next = arg in _SECRET_FLAGS
        scrubbed.append(arg)
    return None if scrubbed == list(argv) else scrubbed


def config_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--config FILE`` (env ``RELAY_CONFIG``): the TOML settings file."""
    return click.option(
        "--config", "config_file", type=click.Path(dir_okay=False, path_type=Path),
        envvar="RELAY_CONFIG", default=None,
        help="TOML settings file, keys as the field names (`dedup-relay example config` prints "
             "every one) [env: RELAY_CONFIG]",
    )(func)


def settings_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--config`` and one flag per settings field to a command; the command receives
    ``config_file`` and each field by its name (None when the flag is not given)."""
    for name, field in reversed(list(Settings.model_fields.items())):
        if name not in FILE_ONLY_SETTINGS:  # a table: the config file (or JSON in its env var)
            func = _option(name, field)(func)
    return config_option(func)


def _option(name: str, field: FieldInfo) -> Callable[[Callable[..., Any]], Any]:
    flag = flag_name(name)
    help_text = f"{field.description} [{_default(name, field)}; env: {env_name(name)}]"
    if plain_annotation(field.annotation) is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", name, default=None, help=help_text)
    if name in _REPEATABLE:
        return click.option(flag, name, multiple=True, callback=_joined,
                            metavar=_metavar(field.annotation),
                            help=f"{help_text} (repeatable, tried in the order given)")
    return click.option(flag, name, default=None, metavar=_metavar(field.annotation),
                        help=help_text)


def _joined(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
            ) -> str | None:
    """A repeated flag's values as one comma-separated list; None when not given (so the env
    var and the file apply)."""
    return ",".join(values) if values else None


def _metavar(annotation: Any) -> str:
    plain = plain_annotation(annotation)
    values = choices(annotation)
    if values is not None:
        return "[" + "|".join(values) + "]"
    if get_origin(plain) is tuple:
        return "A,B,..."
    return {int: "INTEGER", float: "SECONDS", Path: "FILE", SecretStr: "SECRET"}.get(plain,
                                                                                    "TEXT")


def _default(name: str, field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        return f"default: {COMPUTED_DEFAULTS.get(name, 'computed at start')}"
    return f"default: {shown_value(field.default)}"


class SettingsCommand(click.Command):
    """A command whose ``--help`` lists the settings flags in the parts of the settings
    (:data:`relay.settings.SECTIONS`) after the command's own options."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Write the options in sections: the command's own, then one per settings part."""
        sections: list[tuple[str, list[tuple[str, str]]]] = [("Options", [])]
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.name in _SECTIONS:
                sections.append((_SECTIONS[param.name] + " settings", []))
            target = sections[-1][1] if param.name in Settings.model_fields else sections[0][1]
            target.append(record)
        for title, rows in sections:
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
