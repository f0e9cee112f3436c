"""The soak's short setting (two minutes, as issue #10 asks) (``bench/soak.py``; ``make soak`` runs the 10-minute one)."""

from __future__ import annotations

from bench.soak import soak


async def test_short_soak_keeps_every_invariant() -> None:
    r = await soak(duration_s=120, clients=200, seed=11)
    assert sum(r.outcomes.values()) == r.sent, (r.outcomes, r.sent)
    assert r.ledger_after == 0 and r.held_after == 0
    assert r.engine_in_flight_after == 0  # no upstream request outlived its client
    assert {"completed", "rejected", "client_gone"} <= set(r.outcomes), r.outcomes
    assert r.reloads == 1
    # Flat, not leaking: a leak of even 1 KiB per request would show as tens of MiB per minute here.
    assert r.rss_slope_mib_per_min < 20, r.rss_mib
    assert r.fd_slope_per_min < 30, r.fds
