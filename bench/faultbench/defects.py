"""Defects planted in real relay processes, so the nemesis's checker can be shown to catch a
relay that breaks the invariant (tests/system/stores/test_nemesis.py).

Nothing here is a code path of the relay: :func:`shim_env` writes a ``sitecustomize.py``
into a directory of the run and returns the environment that puts it (and the repository, for
``tests``) on ``PYTHONPATH`` with ``FAULTBENCH_DEFECT`` naming the defect; Python imports that
file at the start of every process of the relay (the supervisor and each worker), and it
monkeypatches the relay's rules with :func:`plant` before the relay's own code runs. A relay
started without that environment is the relay as shipped.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from relay.core import rules
from relay.core.interfaces import Outcome, RcptStatus, Reservation, Settle
from relay.core.rules import Action, Classification, KeyReuse, UnknownPolicy, Verdict

ENV = "FAULTBENCH_DEFECT"
REPO = Path(__file__).resolve().parents[2]
_SHIM = f"""import os
if os.environ.get("{ENV}"):
    from bench.faultbench.defects import plant
    plant(os.environ["{ENV}"])
"""


def _inflight_read_as_sent() -> None:
    """A retry that finds another attempt's reservation (PENDING, or SENDING within its
    lease) is answered as a duplicate (250) instead of ``450 4.2.0``: when that attempt then
    fails (its relay killed before the dot, the smarthost's 451), nothing is delivered."""
    original = rules.classify

    def classify(reservation: Reservation, *, unknown_policy: UnknownPolicy,
                 lease_s: float, content_digest: str = "",
                 key_reuse: KeyReuse = "suppress") -> Classification:
        decided = original(reservation, unknown_policy=unknown_policy, lease_s=lease_s,
                           content_digest=content_digest, key_reuse=key_reuse)
        if decided.verdict is not None and decided.verdict.outcome is Outcome.INFLIGHT:
            found = reservation.found
            return Classification(Action.ANSWER, Verdict(
                Outcome.SUPPRESSED, at=found.at if found is not None else None))
        return decided

    rules.classify = classify


def _sent_settle_released() -> None:
    """A recipient the smarthost accepted is settled by releasing its key instead of marking
    it SENT: a retry of the message (a reply the client never got, another recipient's 451)
    sends it again."""
    rules._SETTLE[RcptStatus.ACCEPTED] = Settle.RELEASE


DEFECTS: dict[str, Callable[[], None]] = {
    "inflight-read-as-sent": _inflight_read_as_sent,
    "sent-settle-released": _sent_settle_released,
}
"""Every defect by name, with what it breaks in its docstring."""


def plant(name: str) -> None:
    """Plant the defect ``name`` in this process. Raises ``KeyError`` for an unknown name."""
    DEFECTS[name]()


def shim_env(directory: Path, name: str) -> dict[str, str]:
    """Write the ``sitecustomize.py`` shim into ``directory`` (created) and return the
    environment of a relay process with the defect ``name``. Raises ``KeyError`` for an
    unknown name."""
    if name not in DEFECTS:
        raise KeyError(f"no planted defect {name!r}: one of {', '.join(DEFECTS)}")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_SHIM)
    return {"PYTHONPATH": f"{directory}:{REPO}", ENV: name}
