"""The admission core: pure, synchronous, standard library only.

``demand.build`` prices a request once at intake; ``decide(demand, situation)`` admits, holds or
rejects it and hands back the charge to book in the ``Ledger``. The shell (``sidecar/intake/demand.py``,
``sidecar/admission/controller.py``) builds the inputs and books the result; nothing here does I/O or reads a
clock. ``tests/test_core_imports.py`` keeps this package free of anything outside the standard library.
"""

from sidecar.core.decide import Situation, charge_of, decide, headroom_bytes, retry_after_s
from sidecar.core.decision import Action, Charge, Check, Decision, Reason
from sidecar.core.demand import Demand, build, reprice
from sidecar.core.ledger import Ledger, LedgerTotals
from sidecar.core.rules import Rules
from sidecar.core.snapshot import Snapshot

__all__ = [
    "Action",
    "Charge",
    "Check",
    "Decision",
    "Demand",
    "Ledger",
    "LedgerTotals",
    "Reason",
    "Rules",
    "Situation",
    "Snapshot",
    "build",
    "charge_of",
    "decide",
    "headroom_bytes",
    "reprice",
    "retry_after_s",
]
