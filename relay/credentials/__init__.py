"""Who may sign in, and what a password guesser can cost: the users files, password hashing,
the verified cache, the guess budget and the rule of password attempts that SMTP AUTH
(:mod:`relay.smtp.auth`, the SASL mechanisms) and the console's sign-in
(:mod:`relay.console.signin`) share (design.md §5.1, §6.9).

- :mod:`~relay.credentials.entries`: a users file's lines (:func:`hash_password`,
  :func:`format_entry`, the checks of a user name, a hash, a role);
- :mod:`~relay.credentials.users`: :class:`CredentialFile`, the file loaded, its hash checks;
- :mod:`~relay.credentials.verified`: :class:`VerifiedCache`, credentials verified recently;
- :mod:`~relay.credentials.budget`: :class:`GuessBudget`, attempts per client address;
- :mod:`~relay.credentials.user_turns`: the checks of one user name take turns;
- :mod:`~relay.credentials.hash_threads`: the threads hash checks run in (nice +10);
- :mod:`~relay.credentials.attempts`: :class:`Attempts`, the rule over all of them.

It imports no network library (aiosmtpd, aiohttp): the SMTP adapter, the console, the settings
and the CLI import it, it imports only the core (import contracts in pyproject.toml).
"""

from relay.credentials.attempts import AttemptResult, Attempts, failure_floor_s
from relay.credentials.budget import GuessBudget
from relay.credentials.entries import Scheme, format_entry, hash_password
from relay.credentials.users import CredentialFile
from relay.credentials.verified import VERIFIED_TTL_S, VerifiedCache

__all__ = [
    "VERIFIED_TTL_S",
    "AttemptResult",
    "Attempts",
    "CredentialFile",
    "GuessBudget",
    "Scheme",
    "VerifiedCache",
    "failure_floor_s",
    "format_entry",
    "hash_password",
]
