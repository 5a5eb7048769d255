"""Start-up checks of the Redis servers behind a store (design.md §3).

A fingerprint that Redis evicts under memory pressure, or forgets in a restart, lets a
duplicate through. These checks read ``maxmemory-policy``, ``appendonly`` and ``save`` with
``CONFIG GET`` and turn what they find into readable warnings; they never fail the start-up.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import ResponseError

ConfigGet = Callable[[str], Awaitable[Any]]  # CONFIG GET <name> on one server

_ERROR_TEXT_MAX = 300  # characters of a refusal kept in the warning


def config_setting(config: Any, name: str) -> str | None:
    """Read ``name`` from a CONFIG GET answer, whose keys and values may be bytes or str."""
    if not isinstance(config, dict):
        return None
    for raw_key, raw_value in config.items():
        key = raw_key.decode("utf-8", "replace") if isinstance(raw_key, bytes) else str(raw_key)
        if key.lower() == name:
            if isinstance(raw_value, bytes):
                return raw_value.decode("utf-8", "replace")
            return str(raw_value)
    return None


async def server_warnings(where: str, config_get: ConfigGet) -> list[str]:
    """Warnings about one server, named ``where`` in them (e.g. ``Redis at 10.0.0.5:6379``).

    Warns when ``maxmemory-policy`` is not ``noeviction``, when persistence is off (``appendonly
    no`` and an empty ``save``), and when either cannot be read (CONFIG refused, as on many
    managed services, or the setting not reported). Connection errors propagate.
    """
    try:
        policy = config_setting(await config_get("maxmemory-policy"), "maxmemory-policy")
        appendonly = config_setting(await config_get("appendonly"), "appendonly")
        save = config_setting(await config_get("save"), "save")
    except ResponseError as exc:
        return [
            f"could not check {where} maxmemory-policy and persistence (CONFIG GET refused: "
            f"{str(exc)[:_ERROR_TEXT_MAX]}); make sure maxmemory-policy is noeviction and "
            "AOF or RDB snapshots are on"
        ]
    warnings = []
    if policy is None:
        warnings.append(
            f"could not check {where} maxmemory-policy (not reported by CONFIG GET); "
            "make sure it is noeviction"
        )
    elif policy != "noeviction":
        warnings.append(
            f"{where} maxmemory-policy is {policy!r}, not 'noeviction': under memory pressure "
            "Redis may evict fingerprints and let duplicates through"
        )
    if appendonly is None or save is None:
        warnings.append(
            f"could not check {where} persistence (appendonly or save not reported by CONFIG "
            "GET); make sure AOF or RDB snapshots are on"
        )
    elif appendonly.lower() == "no" and not save.strip():
        warnings.append(
            f"{where} persistence is off (appendonly no, save \"\"): a restart of it with no "
            "replica to take over forgets every fingerprint and lets duplicates through"
        )
    return warnings
