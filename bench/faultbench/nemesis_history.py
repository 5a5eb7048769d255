"""The nemesis's history, collected at the end of a run for the checker: the clients'
records, the smarthost's dots (``dots.jsonl``), each fingerprint's final store record (read
with the relay's own store code), ``dedup-relay in-doubt --json`` (run as the operator runs
it), and the copies the relays' logs announce as sent again over a record in doubt.

Also the relay log lines that name a fingerprint's recipient (the relays log recipients in
full), for the timeline a failing run prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.faultbench.checker import ClientRecord, Dot, Fingerprint, History
from bench.faultbench.lib import log_entries
from relay.core.keys import KeyRules, recipient_key
from relay.settings import Settings

TEMPLATE = "bench"
"""The X-Template of every bench message (``bench.faultbench.traffic.BenchMessage``)."""
CLI_TIMEOUT_S = 60.0


def store_keys(clients: Iterable[ClientRecord], prefix: str) -> dict[str, Fingerprint]:
    """Each fingerprint's store key as the relay derives it, mapped to the fingerprint."""
    rules = KeyRules(key_prefix=prefix)
    return {recipient_key(fp[0], TEMPLATE, fp[1], rules).key: fp
            for client in clients for fp in client.fingerprints()}


def read_dots(path: Path) -> list[Dot]:
    """The smarthost's ``dots.jsonl``."""
    dots = []
    for line in path.read_text(encoding="utf-8").splitlines():
        e = json.loads(line)
        dots.append(Dot(float(e["t"]), str(e["key"]), tuple(e["rcpts"]), str(e["fate"]),
                        bool(e["taken"])))
    return dots


async def read_records(store_url: str, prefix: str,
                       keys: dict[str, Fingerprint]) -> dict[Fingerprint, str]:
    """Each fingerprint's record in the store at ``store_url`` (its state's name)."""
    values: dict[str, Any] = {"upstream": "127.0.0.1:25", "store": store_url,
                                 "store_prefix": prefix, "store_timeout": 10.0}
    settings = Settings(**values)
    store = await settings.open_store(window_s=3600.0)
    try:
        return {fp: (await store.inspect(key)).state.value for key, fp in keys.items()}
    finally:
        await store.close()


async def in_doubt_listed(store_url: str, prefix: str, ledger_url: str, cwd: Path,
                          keys: dict[str, Fingerprint]) -> set[Fingerprint]:
    """The fingerprints ``dedup-relay in-doubt --json`` lists. Raises RuntimeError when the
    command fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env["RELAY_STORE_PREFIX"] = prefix
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relay", "in-doubt", "--json", "--limit", "1000000",
        "--store", store_url, "--ledger", ledger_url, cwd=cwd, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeError("dedup-relay in-doubt did not answer in time") from None
    if proc.returncode != 0:
        raise RuntimeError(f"dedup-relay in-doubt exited {proc.returncode}: "
                           f"{err.decode(errors='replace')[-500:]}")
    listed = set()
    for row in json.loads(out):
        fp = keys.get(str(row["store_key"]))
        listed.add(fp if fp is not None else (str(row["recipient"]).lower(), str(row["key"])))
    return listed


def resent(paths: Iterable[Path], keys: dict[str, Fingerprint]) -> Counter[Fingerprint]:
    """Copies the relays announced as sent again over a record in doubt ("possible
    duplicate", ``unknown_policy = send``), per fingerprint."""
    found: Counter[Fingerprint] = Counter()
    for entry in log_entries(paths):
        if "possible duplicate" in str(entry.get("message", "")):
            fp = keys.get(str(entry.get("key")))
            if fp is not None:
                found[fp] += 1
    return found


def relayed(paths: Iterable[Path]) -> Counter[Fingerprint]:
    """Copies the relays logged as relayed (their decision line's outcome: the smarthost's 2yz
    read), per fingerprint; the key is the message's Message-ID (``<key@bench.test>``)."""
    found: Counter[Fingerprint] = Counter()
    for entry in log_entries(paths):
        outcomes = entry.get("outcomes")
        if entry.get("message") == "message" and isinstance(outcomes, dict):
            key = str(entry.get("message_id", "")).strip("<>").split("@", 1)[0]
            for rcpt, outcome in outcomes.items():
                if outcome == "relayed":
                    found[(str(rcpt).lower(), key)] += 1
    return found


def ledger_rows_lost(paths: Iterable[Path]) -> int:
    """Audit ledger rows the relays logged as never written (a relay stopped with rows still
    queued); a killed relay's queued rows are gone without a line."""
    lost = 0
    for entry in log_entries(paths):
        found = re.match(r"audit ledger: (\d+) row\(s\) not written", str(entry.get("message")))
        lost += int(found.group(1)) if found else 0
    return lost


def unhandled_errors(paths: Iterable[Path]) -> list[str]:
    """The relays' unhandled errors: a traceback printed to the log (a process that died on
    an exception) or a line of asyncio's own logger (an exception nobody read); one short
    line each, in log order."""
    found = []
    for path in paths:
        if not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("Traceback"):
                found.append(f"{path.parent.name}: a traceback (a process died)")
                continue
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict) and entry.get("logger") == "asyncio":
                    found.append(f"{path.parent.name}: asyncio: "
                                 f"{str(entry.get('message')).splitlines()[0][:120]}")
    return found


def relay_lines(paths: Iterable[Path], rcpt: str) -> list[tuple[float, str]]:
    """The relay log lines naming ``rcpt``, as (unix time by the relay's clock, short text)."""
    found = []
    for i, path in enumerate(paths):
        for entry in log_entries([path]):
            if rcpt not in json.dumps(entry):
                continue
            with contextlib.suppress(ValueError, TypeError):
                t = datetime.fromisoformat(str(entry["time"])).timestamp()
                text = (f"relay {i} answered {entry.get('reply')!r} {entry.get('outcomes')}"
                        if entry.get("message") == "message"
                        else f"relay {i} {entry.get('level')}: {str(entry.get('message'))[:200]}")
                found.append((t, text))
    return found


def save(history: History, path: Path) -> None:
    """Write ``history`` to ``path`` as JSON (the run's record, for reading after it)."""
    clients = [{"key": c.key, "rcpts": c.rcpts, "end": c.end,
                "replies": [dataclasses.asdict(r) for r in c.replies]} for c in history.clients]
    path.write_text(json.dumps({
        "clients": clients,
        "records": {f"{fp[0]} {fp[1]}": state for fp, state in history.records.items()},
        "listed": sorted(f"{fp[0]} {fp[1]}" for fp in history.listed),
        "resent": {f"{fp[0]} {fp[1]}": n for fp, n in history.resent.items()},
        "relayed": {f"{fp[0]} {fp[1]}": n for fp, n in history.relayed.items()},
    }, indent=1))


async def collect(clients: list[ClientRecord], workdir: Path, store_url: str, prefix: str,
                  ledger_url: str, relay_logs: list[Path]) -> History:
    """The run's whole history (the relays have stopped; the store and ledger still run)."""
    keys = store_keys(clients, prefix)
    listed = await in_doubt_listed(store_url, prefix, ledger_url, workdir, keys)
    records = await read_records(store_url, prefix, keys)
    history = History(clients=clients, dots=read_dots(workdir / "dots.jsonl"),
                      records=records, listed=listed, resent=resent(relay_logs, keys),
                      relayed=relayed(relay_logs))
    save(history, workdir / "history.json")
    return history
