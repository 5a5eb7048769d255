"""What an operator does with fingerprints (design.md §6.5), for the command line
(``dedup-relay fingerprint | inspect | release | mark-sent | stats``, a thin shell over these)
and the console alike:

- :mod:`~relay.admin.records`: compute a fingerprint's key, describe its record, release it
  or mark it sent (audit-logged, compare-and-delete / compare-and-set), its ledger row;
- :mod:`~relay.admin.lookup`: which fingerprint a selection names (a store key within
  ``store_prefix``, or a recipient with its key; not both);
- :mod:`~relay.admin.search`: the audit ledger's query of what support typed (a recipient
  alone, a Message-ID, a queue id, a template, a period);
- :mod:`~relay.admin.decisions`: the audited action, the ledger first, then the store, then
  the row (:func:`decide`);
- :mod:`~relay.admin.stats`: the store's records by state.
"""

from relay.admin.decisions import (
    AuditLedger,
    Decision,
    LedgerRefused,
    Outcome,
    decide,
    open_ledger,
)
from relay.admin.lookup import (
    Selection,
    SelectionError,
    SelectionProblem,
    own_store_key,
    selected_key,
    selected_keys,
)
from relay.admin.records import (
    FingerprintInput,
    InFlightError,
    NotInDoubtError,
    OperatorRow,
    changed_meanwhile,
    describe,
    key_for,
    located,
    mark_sent,
    os_user,
    recipient_key_for,
    release,
    store_label,
)
from relay.admin.stats import count_states, stats_report, stats_table

__all__ = [
    "AuditLedger",
    "Decision",
    "FingerprintInput",
    "InFlightError",
    "LedgerRefused",
    "NotInDoubtError",
    "OperatorRow",
    "Outcome",
    "Selection",
    "SelectionError",
    "SelectionProblem",
    "changed_meanwhile",
    "count_states",
    "decide",
    "describe",
    "key_for",
    "located",
    "mark_sent",
    "open_ledger",
    "os_user",
    "own_store_key",
    "recipient_key_for",
    "release",
    "selected_key",
    "selected_keys",
    "stats_report",
    "stats_table",
    "store_label",
]
