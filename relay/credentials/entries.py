"""The lines of a users file: :func:`hash_password`, :func:`format_entry` and the checks of a
line's parts (user name, hash, role) that :meth:`relay.credentials.CredentialFile.load` applies.

A line is ``username:hash`` (the SMTP AUTH users, ``auth_file``) or ``username:hash:role`` (the
console's, ``console_auth_file``); the hash is made by bcrypt (``$2a$``/``$2b$``/``$2y$``) or
argon2 (``$argon2id$``...), neither of which holds a ``:``. No message here quotes a hash.
"""

from __future__ import annotations

import re
from typing import Literal

import bcrypt
from argon2 import PasswordHasher, extract_parameters
from argon2.exceptions import InvalidHashError

Scheme = Literal["argon2", "bcrypt"]

BCRYPT_MAX_BYTES = 72
"""The longest password bcrypt takes (UTF-8 bytes): bcrypt 5 refuses longer secrets instead of
truncating them."""
_BCRYPT_PREFIXES = ("$2a$", "$2b$", "$2y$")
_BCRYPT_HASH = re.compile(r"\$2[aby]\$(0[4-9]|[12]\d|3[01])\$[./A-Za-z0-9]{53}")
_ROLE = re.compile(r"[a-z][a-z_]*")


def hash_password(password: str, *, scheme: Scheme = "argon2") -> str:
    """Hash ``password`` (UTF-8) for the credentials file.

    ``argon2`` is argon2id with argon2-cffi's ``PasswordHasher`` defaults; ``bcrypt`` uses
    ``bcrypt.gensalt()`` (cost 12). Raises ValueError for an empty password (SASL PLAIN
    cannot carry one), for a bcrypt password longer than 72 UTF-8 bytes, or for an unknown
    ``scheme``.
    """
    if not password:
        raise ValueError("the password is empty")
    secret = password.encode("utf-8")
    if scheme == "argon2":
        return PasswordHasher().hash(secret)
    if scheme == "bcrypt":
        if len(secret) > BCRYPT_MAX_BYTES:
            raise ValueError("bcrypt takes at most 72 UTF-8 bytes of password; use argon2")
        return bcrypt.hashpw(secret, bcrypt.gensalt()).decode("ascii")
    raise ValueError(f"unknown hash scheme {scheme!r} (argon2 or bcrypt)")


def format_entry(username: str, password_hash: str, role: str | None = None) -> str:
    """Return the credentials file line ``username:hash``, or ``username:hash:role`` with a
    ``role`` (without a newline).

    Raises ValueError when ``username`` is empty, starts with ``#``, or holds ``:``,
    whitespace or a control character, when ``password_hash`` is not a bcrypt or argon2
    hash, or when ``role`` is empty or not a lowercase word; the message never repeats the
    hash.
    """
    reason = username_problem(username) or hash_problem(password_hash)
    if reason is None and role is not None and not _ROLE.fullmatch(role):
        reason = f"the role {role!r} is not a lowercase word"
    if reason is not None:
        raise ValueError(reason)
    return f"{username}:{password_hash}" + ("" if role is None else f":{role}")


def username_problem(username: str) -> str | None:
    """Why ``username`` cannot be a credentials file user, or None when it can."""
    if not username:
        return "the username is empty"
    if username.startswith("#"):
        return "the username starts with '#' (a comment)"
    if any(ch == ":" or ch.isspace() or not ch.isprintable() for ch in username):
        return "the username holds ':', whitespace or a control character"
    return None


def scheme_of(password_hash: str) -> Scheme | None:
    """The scheme a hash was made by (from its prefix), None for neither."""
    if password_hash.startswith(_BCRYPT_PREFIXES):
        return "bcrypt"
    if password_hash.startswith("$argon2"):
        return "argon2"
    return None


def hash_problem(password_hash: str) -> str | None:
    """Why ``password_hash`` is not a usable hash, or None; never quotes the hash."""
    scheme = scheme_of(password_hash)
    if scheme is None:
        return "the password hash is neither bcrypt ($2a$, $2b$, $2y$) nor argon2 ($argon2)"
    if scheme == "bcrypt":
        if not _BCRYPT_HASH.fullmatch(password_hash):
            return "the bcrypt hash is malformed"
        return None
    try:
        extract_parameters(password_hash)
    except InvalidHashError:
        return "the argon2 hash is malformed"
    if any(ch.isspace() or not ch.isprintable() or ch == ":" for ch in password_hash):
        return "the argon2 hash is malformed"
    return None


def role_problem(role: str | None, roles: tuple[str, ...] | None) -> str | None:
    """Why ``role`` is not one of ``roles`` (None: a file without roles), or None."""
    if roles is None or role in roles:
        return None
    return f"unknown role {role!r} (one of {', '.join(roles)})"
