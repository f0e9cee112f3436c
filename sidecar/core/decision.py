"""What the decision returns: an action, the reason, every check's numbers, and the charge to book."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from sidecar.core.values import fast_init


class Action(StrEnum):
    ADMIT = "admit"
    HOLD = "hold"
    REJECT = "reject"


class Reason(StrEnum):
    """Stable reason codes: headers, metrics labels and dashboards depend on these strings."""

    VRAM_HEADROOM = "vram_headroom"
    KV_POOL = "kv_pool"
    MAMBA_SLOTS = "mamba_slots"
    ENGINE_QUEUE = "engine_queue"
    PENDING_PREFILL_TOKENS = "pending_prefill_tokens"
    UNFIT_REQUEST = "unfit_request"
    SIGNALS_STALE = "signals_stale"
    QUEUE_FULL = "queue_full"
    HOLD_TIMEOUT = "hold_timeout"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    DRAINING = "draining"
    # An admitted request aborted by the in-flight guard before its prefill peak (``core/overrun.py``).
    PREFILL_OVERRUN = "prefill_overrun"


# ``Decision.check`` of a request held behind an earlier one (strict order), whatever that one waits for.
STRICT_ORDER = "strict_order"


@fast_init
@dataclass(frozen=True, slots=True)
class Check:
    """One step's verdict with the numbers that decided it (for explain and the decision log)."""

    name: str
    ok: bool
    need: float | None = None
    have: float | None = None
    note: str = ""
    # unfit_request only: which limit the request exceeds ("context", "kv_pool", "mamba_slots",
    # "transient"). A request longer than the context is answered differently (a 400, as SGLang does)
    # from one this lane can never run (another lane might).
    limit: str = ""


@dataclass(frozen=True, kw_only=True)
class Booked:
    """The quantities the ledger books: declared once, for one request's charge and for the ledger's
    totals over every request it holds (``ledger.LedgerTotals``), which add and subtract them by name.

    A declaration, never built itself: its ``__slots__`` is empty, so each subclass (``Charge``,
    ``LedgerTotals``, ``slots=True``) holds every field in its own slots, and ``values.positional``
    builds those (four per gated request) through a twin class, ~2.5x cheaper than through each
    slot's descriptor (issue #27, evidence QL1).
    """

    __slots__ = ()

    prefill_tokens: int = 0
    kv_tokens: int = 0
    projected_bytes: int = 0
    mamba_slots: int = 0
    # Prefills priced by their own chunk schedule (``decide``): 1 on such a request's charge.
    own_prefills: int = 0


# Its subclasses refuse assignment with their own ``__setattr__``; Booked's own (never called: it has no
# instances) would also refuse the stores of the twin ``values.positional`` fills.
del Booked.__setattr__, Booked.__delattr__


@fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Charge(Booked):
    """What the ledger books for an admitted request until its prefill is done.

    ``mamba_slots`` is 0 on a lane without a Mamba pool; ``sequences`` is what the request adds to the
    engine's queue (every prompt times every sample of it).
    """

    sequences: int = 1


@fast_init
@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: Reason | None
    retry_after_s: int | None = None
    headroom_bytes: int | None = None
    checks: tuple[Check, ...] = field(default_factory=tuple)
    # What admitting this request books (also set on a hold or a rejection: shadow mode forwards those).
    charge: Charge = Charge()
    # The check that held or rejected it (its name in ``checks``; ``strict_order`` for one held behind
    # an earlier request): what tells apart holds of one reason (``vram_headroom``: ``batch_join``,
    # ``join_pending``, ``own_schedule``). None for an admission.
    check: str | None = None

    @property
    def admitted(self) -> bool:
        return self.action is Action.ADMIT
