"""The per-request metrics are tallied in plain numbers and written to their Prometheus series when the
registry is read (``ops/telemetry.py``: ``CounterTally``, ``HistogramTally``): what a scrape shows must be
exactly what the Prometheus objects themselves would have shown, at every read."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from sidecar.ops.telemetry import HOLD_BUCKETS, CounterTally, HistogramTally, Telemetry, _FlushTallies


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample but the creation timestamps (two objects are created at different instants)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in registry.collect()
        for s in m.samples
        if not s.name.endswith("_created")
    }


def _pair() -> tuple[CollectorRegistry, CounterTally, HistogramTally, CollectorRegistry, Any, Histogram]:
    tallied = CollectorRegistry()
    tallies: list = []
    tallied.register(_FlushTallies(tallies))
    counter = CounterTally(Counter("c", "c", ["x"], registry=tallied).labels("a"))
    hist = HistogramTally(Histogram("h", "h", buckets=HOLD_BUCKETS, registry=tallied))
    tallies += [counter, hist]
    plain = CollectorRegistry()
    return (
        tallied,
        counter,
        hist,
        plain,
        Counter("c", "c", ["x"], registry=plain).labels("a"),  # pre-bound, as the telemetry's are
        Histogram("h", "h", buckets=HOLD_BUCKETS, registry=plain),
    )


amounts = st.one_of(
    st.sampled_from([0.0, *HOLD_BUCKETS, math.inf, math.nan]),  # every bound exactly, and the odd ones
    st.floats(min_value=0, max_value=4000, allow_nan=False),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(amounts, st.booleans()), max_size=60))
def test_every_read_shows_what_prometheus_would(steps: list[tuple[float, bool]]) -> None:
    tallied, counter, hist, plain, p_counter, p_hist = _pair()
    for amount, read in steps:
        counter.inc()
        p_counter.inc()
        hist.observe(amount)
        p_hist.observe(amount)
        if read:  # a scrape in between: the series are set, not added to, so reading twice is harmless
            got, want = _samples(tallied), _samples(plain)
            assert got.keys() == want.keys()
            for k, v in want.items():
                assert got[k] == v or (math.isnan(v) and math.isnan(got[k])), k
    got, want = _samples(tallied), _samples(plain)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == v or (math.isnan(v) and math.isnan(got[k])), k


def test_the_telemetry_series_are_written_before_a_scrape_reads_them() -> None:
    registry = CollectorRegistry()
    t = Telemetry(registry)
    t.first_byte(0.2)
    t.first_byte(7.0)
    text = generate_latest(registry).decode()
    assert "sglang_sidecar_upstream_first_byte_seconds_count 2.0" in text
    assert 'sglang_sidecar_upstream_first_byte_seconds_bucket{le="0.25"} 1.0' in text
    assert registry.get_sample_value("sglang_sidecar_upstream_first_byte_seconds_sum") == 7.2
    t.close()
