"""The per-request families (decisions, held, requests, hold_seconds, upstream_first_byte_seconds) are
plain numbers written at scrape time (``telemetry._PerRequest``): /metrics must print them exactly as
prometheus_client's own Counter and Histogram did, fed the same events (issue #27)."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import metrics as prometheus_metrics

from sidecar.admission.controller import Outcome
from sidecar.core import demand
from sidecar.core.decision import Action, Decision, Reason
from sidecar.core.ledger import LedgerTotals
from sidecar.ops import telemetry
from sidecar.ops.telemetry import FIRST_BYTE_BUCKETS, HOLD_BUCKETS, HOLD_REASONS, PREFIX, Telemetry
from sidecar.policy.in_force import rules_of
from tests.conftest import small_policy

FAMILIES = ("decisions", "held", "requests", "hold_seconds", "upstream_first_byte_seconds")
# Values on and around the bucket bounds, below the first, past the last, infinite and NaN.
WAITS = (0.0, 5.27e-05, 0.005, 0.0050001, 0.05, 0.3, 1.0, 29.9, 1800.0, 1e9, math.inf, -0.5, math.nan)


class Reference:
    """The families built with prometheus_client's classes, in Telemetry's order, fed the same events."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            PREFIX + "decisions",
            "Final admission decisions, one per gated request that got one: admit, or reject by reason",
            ["decision", "reason"],
            registry=r,
        )
        self.admits = self.decisions.labels("admit", "none")
        for reason in Reason:
            if reason is not Reason.PREFILL_OVERRUN:
                self.decisions.labels("reject", reason.value)
        self.held = Counter(
            PREFIX + "held",
            "Gated requests parked in the hold queue, by the reason they were held and the check that "
            "held them (strict_order: behind an earlier request), whatever came next",
            ["reason", "check"],
            registry=r,
        )
        for reason in HOLD_REASONS:
            self.held.labels(reason.value, reason.value)
        self.requests = Counter(
            PREFIX + "requests", "Gated requests by how they ended, one per request", ["outcome"], registry=r
        )
        for o in Outcome:
            self.requests.labels(o.value)
        self.hold = Histogram(
            PREFIX + "hold_seconds",
            "Time from arrival to the final decision (0 for a request decided at once)",
            buckets=HOLD_BUCKETS,
            registry=r,
        )
        self.first_byte = Histogram(
            PREFIX + "upstream_first_byte_seconds",
            "Time from forwarding an admitted request to the upstream's first body byte "
            "(for a stream, about the time to first token)",
            buckets=FIRST_BYTE_BUCKETS,
            registry=r,
        )


def _families(text: bytes) -> list[str]:
    """The lines of the five families (help, type, samples), in the order /metrics writes them."""
    names = {
        PREFIX + f + s for f in FAMILIES for s in ("", "_total", "_created", "_bucket", "_count", "_sum")
    }
    lines = text.decode().splitlines()
    return [
        ln for ln in lines if (ln.split(" ")[2] if ln[0] == "#" else ln.split("{")[0].split(" ")[0]) in names
    ]


def _pair(monkeypatch: pytest.MonkeyPatch, shadow: bool) -> tuple[Telemetry, Reference]:
    # One instant for every series' start in both (those made on first use too), so their _created
    # samples compare.
    monkeypatch.setattr(telemetry.time, "time", lambda: 1765000000.123)  # the one time module
    return Telemetry(CollectorRegistry(), shadow=shadow), Reference()


def _feed(tel: Telemetry, ref: Reference, shadow: bool) -> None:
    rules = rules_of(small_policy().policy)
    cost = demand.build(rules, 100, arrived_at=0.0, request_id="r-1")
    ledger = LedgerTotals()
    for w in WAITS:
        tel.decision(Decision(Action.ADMIT, None), cost, w, ledger)
        ref.admits.inc()
        ref.hold.observe(w)
        tel.first_byte(w)
        ref.first_byte.observe(w)
    for reason, w in ((Reason.QUEUE_FULL, 0.0), (Reason.HOLD_TIMEOUT, 31.0), (Reason.VRAM_HEADROOM, 0.2)):
        tel.decision(Decision(Action.REJECT, reason), cost, w, ledger)
        ref.decisions.labels("reject", reason.value).inc()
        ref.hold.observe(w)
    tel.decision(Decision(Action.REJECT, None), cost, 0.1, ledger)  # counted as unfit_request
    ref.decisions.labels("reject", "unfit_request").inc()
    ref.hold.observe(0.1)
    # A hold by a reason's own check, by another check (a series made on first use), by no reason.
    for reason, check in ((Reason.KV_POOL, None), (Reason.VRAM_HEADROOM, "strict_order"), (None, None)):
        tel.decision(Decision(Action.HOLD, reason, check=check), cost, 0.0, ledger)
        r = reason or Reason.VRAM_HEADROOM
        ref.held.labels(r.value, check or r.value).inc()
        if shadow:
            ref.admits.inc()
            ref.hold.observe(0.0)
    tel.decision(Decision(Action.REJECT, Reason.PREFILL_OVERRUN), cost, 0.0, ledger)  # no counter
    for o in (*Outcome, Outcome.COMPLETED, Outcome.REJECTED):
        tel.outcome(o)
        ref.requests.labels(o.value).inc()


@pytest.mark.parametrize("shadow", [False, True])
@pytest.mark.parametrize("created", [True, False])
def test_the_exposition_is_prometheus_clients(
    monkeypatch: pytest.MonkeyPatch, shadow: bool, created: bool
) -> None:
    tel, ref = _pair(monkeypatch, shadow)
    assert _families(generate_latest(tel.registry)) == _families(generate_latest(ref.registry))
    _feed(tel, ref, shadow)
    if not created:
        monkeypatch.setattr(prometheus_metrics, "_use_created", False)
    ours, theirs = _families(generate_latest(tel.registry)), _families(generate_latest(ref.registry))
    assert ours == theirs
    assert any("_created" in line for line in ours) is created
    # The lines compared are the families' whole text: help, type, every series.
    assert len(ours) == len(theirs) > 60


def test_the_families_keep_their_names_in_the_registry() -> None:
    """Registered by name, as the library's classes were: a second collector of one is refused."""
    registry = CollectorRegistry()
    Telemetry(registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Counter(PREFIX + "requests", "again", registry=registry)
    assert registry.get_sample_value(PREFIX + "requests_total", {"outcome": "completed"}) == 0.0
