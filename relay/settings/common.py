"""What every settings section shares: the :class:`Section` base, how a setting is named to an
operator (flag, env var, file key), and the small parsers and file checks the sections use.

A section module imports this one and no other section (an import-linter contract): a rule
between sections lives in :mod:`relay.settings`.
"""

from __future__ import annotations

import importlib
import ipaddress
import os
import re
import ssl
import stat
import types
from collections.abc import Callable, Iterable, Set
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict
from pydantic_settings import NoDecode

from relay.core.errors import ConfigError
from relay.store.kinds import NamedFile, StoreKind
from relay.store.postgres.kind import POSTGRES
from relay.store.registry import kind_of

ENV_PREFIX = "RELAY_"

# a list setting: a TOML array, or in an env var / flag a comma-separated string
CsvList = Annotated[tuple[str, ...], NoDecode]

FileCheck = tuple[tuple[str, ...], Callable[[], object]]
"""One check of what settings name outside themselves: the setting names it reports under, and
an action that raises :class:`ConfigError` when the file (or pair of files) is unusable."""

SecretFile = tuple[str, Path]
"""A file that holds a secret (a password, a private key, a token, password hashes): how an
operator names it (a setting, or ``upstream NAME: password_file``), and its path."""


class Section(BaseModel):
    """One part's settings: its fields and validators, the builder of its part, its file checks
    (:meth:`file_checks`), the names it applies on reload (:attr:`LIVE`) and whose file content
    a reload compares (:attr:`FILES`), and its title in ``--help`` and docs/settings.md.

    Every section is mixed into :class:`relay.settings.Settings`; a method that several
    sections define (``file_checks``) is called through the class
    (``StoreSettings.file_checks(settings)``), never through the mixed object."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    TITLE: ClassVar[str] = ""
    LIVE: ClassVar[tuple[str, ...]] = ()
    FILES: ClassVar[tuple[str, ...]] = ()

    def file_checks(self, *, live: bool) -> list[FileCheck]:
        """The checks of the files this section names, as the relay will read them (no
        connection opened, no port bound). ``live``: for a reload of a running process."""
        return []

    def secret_files(self) -> list[SecretFile]:
        """The files this section names that hold a secret (their mode is checked by
        :func:`secret_file_exposure`)."""
        return []


# what --help and docs/settings.md say for a default computed at start
COMPUTED_DEFAULTS = {"hostname": "this host's FQDN"}


def plain_annotation(annotation: Any) -> Any:
    """A setting's type annotation without ``| None``."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def choices(annotation: Any) -> tuple[str, ...] | None:
    """The values a setting of this type may take (a ``Literal`` or an ``Enum``), or None."""
    plain = plain_annotation(annotation)
    if get_origin(plain) is Literal:
        return tuple(str(v) for v in get_args(plain))
    if isinstance(plain, type) and issubclass(plain, Enum):
        return tuple(str(m.value) for m in plain)
    return None


def shown_value(value: object, mark: Callable[[str], str] = str, sep: str = ",") -> str:
    """A setting's default as ``--help`` and docs/settings.md show it: ``unset``, ``empty`` (a
    list), ``"" (off)``, else the value as a file holds it; ``mark`` wraps each literal (the docs:
    in backticks), ``sep`` joins a list's items."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return mark("true" if value else "false")
    if isinstance(value, float):
        return mark(f"{value:g}")
    if isinstance(value, tuple):
        return sep.join(mark(str(v)) for v in value) if value else "empty"
    if value == "":
        return f'{mark(chr(34) * 2)} (off)'
    if isinstance(value, Enum):
        return mark(str(value.value))
    return mark(str(value))


def split_csv(value: object) -> object:
    """A list setting given as a string (env var, flag): its comma-separated items, stripped,
    blanks dropped; any other value as it is (a pydantic ``mode="before"`` validator)."""
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return value


def flag_name(field: str) -> str:
    """The command-line flag of the setting ``field``: ``lease`` -> ``--lease``,
    ``store_timeout`` -> ``--store-timeout`` (a bool's negation is ``--no-`` + that)."""
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    """The env var of the setting ``field``: ``store_timeout`` -> ``RELAY_STORE_TIMEOUT``."""
    return ENV_PREFIX + field.upper()


def setting_names(field: str, flagged: Set[str] | None = None) -> str:
    """Where an operator sets ``field``, for messages: flag (when the command offers it:
    ``flagged`` holds the field names it does; None: all), env var and file key."""
    names = f"{env_name(field)} or `{field}` in the file"
    if flagged is None or field in flagged:
        names = f"{flag_name(field)}, {names}"
    return names


class SettingsRuleError(ValueError):
    """A rule between settings is broken; ``fields`` are the settings it names (the error
    message then says where each one is set)."""

    def __init__(self, message: str, *fields: str) -> None:
        super().__init__(message)
        self.fields = fields


def split_host_port(value: str, *, what: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` for IPv6) into ``(host, port)``.

    Raises ValueError with a readable message when the form or the port (0-65535) is wrong.
    """
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"{what} must be HOST:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        ipaddress.IPv6Address(host)
    return host, int(port_text)


_DOMAIN_NAME = re.compile(r"[A-Za-z0-9_.:\-\[\]]+")


def check_domain_name(value: str, *, what: str) -> str:
    """``value`` when it is a Domain or address-literal as it goes into a greeting, EHLO or a
    ``Received:`` header verbatim (RFC 5321 section 4.1.2), where a blank or line break would
    break the command or the header; ValueError naming ``what`` otherwise."""
    if not _DOMAIN_NAME.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} is not a domain name or [address literal] (ASCII letters, "
            "digits, '-', '.', '_', ':' and brackets; an IDN in its xn-- form)")
    return value


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (RFC 3986 section 3.2.2)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_SECRET_PARAM = re.compile(r"(?i)([?&][^=&#]*password[^=&#]*=)[^&#]*")


def redact_url(url: str) -> str:
    """``url`` fit for logs: the password of the userinfo and of any query parameter whose
    name holds "password" (``sentinel_password=``) become ``***``; for a sqlite:/// URL the
    file's absolute path (a relative one depends on the working directory: a store kind's
    :attr:`~relay.store.kinds.StoreKind.shown`)."""
    kind = kind_of(url)
    if kind is not None and kind.shown is not None:
        return kind.shown(url)
    scheme, sep, rest = url.partition("://")
    authority, slash, tail = rest.partition("/")
    creds, at, hosts = authority.rpartition("@")
    if at and ":" in creds:  # a user without a password is shown as it is
        user = creds.split(":", 1)[0]
        authority = f"{user}:***@{hosts}"
    return _SECRET_PARAM.sub(r"\1***", f"{scheme}{sep}{authority}{slash}{tail}")


def read_secret_file(path: Path, label: str, where: str = "") -> str:
    """The text of the secret file ``path`` without surrounding whitespace (a Docker or
    systemd secret's final newline is not part of it). Raises ConfigError
    ``<label>: <why>: <path><where>`` when it cannot be read or holds nothing."""
    try:
        secret = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8"
        raise ConfigError(f"{label}: {reason}: {path}{where}") from exc
    if not secret:
        raise ConfigError(f"{label}: {path} is empty{where}")
    return secret


def secret_file_exposure(path: Path) -> str | None:
    """Who besides this process's user may read or change the secret file ``path`` (OpenSSH's
    rule for a private key: no permission for its group or others), in words for a WARNING
    that names it; None when nobody may, or when it cannot be looked at (its check says
    why). Read access through the file's group is left alone when the file is another user's
    (root's) and that group is one of this process's: it is how the relay reads it (a
    Kubernetes secret volume with ``fsGroup``)."""
    try:
        status = path.stat()
    except OSError:
        return None
    if not stat.S_ISREG(status.st_mode):
        return None
    loose = status.st_mode & 0o077
    if status.st_uid != os.geteuid() and status.st_gid in {os.getegid(), *os.getgroups()}:
        loose &= ~0o040
    if not loose:
        return None
    who = [name for name, bits in (("its group", 0o070), ("other users", 0o007))
           if loose & bits]
    return (f"{path} is open to {' and '.join(who)} (mode {status.st_mode & 0o777:04o}): it "
            f"holds a secret; make it readable by its owner only (chmod go= {path})")


def secret_setting(path: Path, field: str) -> str:
    """The text of the secret file ``path`` that setting ``field`` names (stripped). Raises
    ConfigError naming the setting when it cannot be read or holds nothing."""
    return read_secret_file(path, field, f" ({setting_names(field)})")


def readable(path: Path, what: str) -> None:
    """Raise ConfigError unless ``path`` is a file this process can read."""
    if not path.exists():
        raise ConfigError(f"{what}: no such file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{what}: not readable by this user")


def writable_file(path: Path, what: str) -> None:
    """Raise ConfigError unless the file ``path`` can be written: it is a writable file, or it
    is missing and its nearest existing parent is a writable directory (the rest is made)."""
    if path.exists():
        if not path.is_file() or not os.access(path, os.R_OK | os.W_OK):
            raise ConfigError(f"{what} {path} is not a file this user can read and write")
        return
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path} cannot be made: {parent} is not a directory this "
                          "user can write")


def load_tls(load: Callable[[], Any], what: str) -> None:
    """Run ``load``; raise ConfigError saying ``what`` when it fails with an SSL/OS error."""
    try:
        load()
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"{what} ({exc})") from exc


def ca_bundle(path: Path, what: str) -> Callable[[], None]:
    """A check that ``path`` holds PEM CA certificates (loaded as a client context's
    verify locations); its ConfigError says ``what``."""
    return lambda: load_tls(lambda: ssl.create_default_context(cafile=path), what)


def client_pair(cert: Path, key: Path | None, what: str) -> Callable[[], None]:
    """A check that ``cert`` and ``key`` load as a client certificate chain and its
    (unencrypted) private key; its ConfigError says ``what``."""
    def load() -> None:
        ssl.create_default_context().load_cert_chain(cert, key, password=lambda: b"")

    return lambda: load_tls(load, what)


# the optional parts of the relay outside the stores and the extra that installs each
# (pyproject.toml); a store kind names its own (relay.store.kinds.Extra)
EXTRAS = {"msal": "oauth", "google.auth": "oauth"}


def extra_missing(module: str, extra: str | None = None) -> str | None:
    """None when ``module`` imports; else what to install, for a configuration error: ``the
    postgres extra is not installed (asyncpg does not import): pip install
    'dedup-relay[postgres]'``. ``extra``: the extra that installs it (None: a key of
    :data:`EXTRAS`)."""
    try:
        importlib.import_module(module)
    except ImportError:
        extra = extra if extra is not None else EXTRAS[module]
        return (f"the {extra} extra is not installed ({module} does not import): "
                f"pip install 'dedup-relay[{extra}]'")
    return None


def kind_extra_missing(kind: StoreKind) -> str | None:
    """:func:`extra_missing` for the driver of the store kind ``kind`` (None: it needs none)."""
    return None if kind.extra is None else extra_missing(kind.extra.module, kind.extra.name)


def check_named_files(files: Iterable[NamedFile]) -> None:
    """Raise ConfigError for the first file a store URL names that is unusable as it will be
    used: ``read`` and ``ca`` readable (``ca`` also PEM CA certificates), ``write`` writable
    or makeable; then its own content check."""
    for file in files:
        if file.use == "write":
            writable_file(file.path, file.what)
        else:
            readable(file.path, file.what)
        if file.use == "ca":
            ca_bundle(file.path, f"{file.what}: not a PEM CA certificate file")()
        if file.check is not None:
            file.check()


def postgres_files(url: str) -> None:
    """Raise ConfigError unless the files a postgresql:// URL names (``sslrootcert``,
    ``sslcert``, ``sslkey``, ``sslcrl``, ``passfile``) are readable (no connection opened):
    the audit ledger's database."""
    check_named_files(POSTGRES.files(url))
