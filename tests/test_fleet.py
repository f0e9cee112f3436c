"""Behind both of SGLang's real routers, on real processes: two emulated Max-Q lanes, a sidecar in front of
each, the router in front of both (round robin). ``smg`` 1.13.0 (the model gateway) and
``sglang-router`` 0.3.2 are both pinned in the test extra: a missing router fails, never skips.

The finding (issues #13, #26): 16 requests no lane can run (8 at a time), answered 503 (the sidecar's
answer before issue 26), are retried by the router and counted as worker failures until its circuit
breaker opens on both lanes; the next small requests, which either lane would serve at once, all get 503
"no available workers". The sidecar's defaults now keep the lanes in: 413 for a request no lane can run
(smg does not retry it and counts it a success for its breaker) and 429 for a busy lane (retried
elsewhere, neutral for smg's breaker). sglang-router 0.3.2 counts every non-2xx against its breaker, so
behind it the documented flags (no breaker; /readyz health checks) are what keep the lanes in.
Bounded: three routers in turn, each case a few seconds; bench/fleet_routers.py runs the whole matrix.
"""

from __future__ import annotations

from pathlib import Path

import sglang_router  # noqa: F401  (the test extra installs both routers)
import smg  # noqa: F401

from sidecar_emulator import fleet as F
from tests.conftest import maxq

SPEED = 20.0
# maxq-old: a prefill beyond ~225K tokens is larger than the lane can ever free (unfit_request). In
# compact input_ids, 0.86 MiB: under smg's 1 MiB retry cut, so smg would retry a 503 (the hard case).
UNFIT_TOKENS = 300_000


async def test_the_sidecars_defaults_never_eject_a_lane_behind_either_real_router(tmp_path: Path) -> None:
    async with F.fleet(tmp_path) as f:
        engines, sets = await F.lanes(
            f, 2, "maxq-old", maxq(), SPEED, sidecars={"default": None, "before": F.ANSWERS_BEFORE_26}
        )
        results = {}
        for case, kind, label, flags in (
            ("smg, 503s", F.SMG, "before", []),
            ("smg, defaults", F.SMG, "default", []),
            ("0.3.2, documented flags", F.SGLANG_ROUTER, "default", F.RECOMMENDED_ROUTER_FLAGS),
        ):
            workers = [s.url for s in sets[label]]
            router = await f.router(f"router-{len(results)}", workers, flags, kind=kind)
            await F.wait_ready(router, "/health")
            async with F.CrashWatch(engines) as watch:
                answers = await F.burst_then_small(router.url, unfit_tokens=UNFIT_TOKENS)
            results[case] = (F.summarize(answers), F.breaker_opens(router), sum(watch.crashes.values()))
            await f.stop(router)

    # The finding, reproduced behind the newest gateway: the 503s open the breaker on both lanes.
    summary, opens, crashes = results["smg, 503s"]
    assert opens == 2, results
    assert summary["small_served"] == 0 and summary["small_statuses"] == {"503": 10}, summary
    assert crashes == 0  # nothing was wrong with either lane

    # The sidecar's defaults, smg at its defaults: every small request served, the client told 413.
    summary, opens, crashes = results["smg, defaults"]
    assert (summary["small_served"], opens, crashes) == (10, 0, 0), results
    assert summary["unfit_statuses"] == {"413": 16} and summary["unfit_codes"] == {"unfit_request": 16}

    # The sidecar's defaults behind 0.3.2 with the documented flags: the same.
    summary, opens, crashes = results["0.3.2, documented flags"]
    assert (summary["small_served"], opens, crashes) == (10, 0, 0), results
    assert summary["unfit_statuses"] == {"413": 16} and summary["unfit_codes"] == {"unfit_request": 16}
