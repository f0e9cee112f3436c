"""Behind SGLang's real router (the `sglang-router` wheel), on real processes: two emulated Max-Q lanes,
a sidecar in front of each, the router in front of both (round robin).

The finding (issue #13): 16 requests no lane can run (8 at a time), answered 503 by the sidecars, are
retried by the router and counted as worker failures until its circuit breaker opens on both lanes;
the next small requests, which either lane would serve at once, all get 503 "no available workers".
The fix is tested the two ways docs/routing.md recommends: the sidecar's answers for routers (413 for a
request the lane can never run: not retried, one failure each) with the router at its defaults, and
the sidecar's default answers with the router's recommended flags (no breaker; /readyz health checks).
"""

from __future__ import annotations

from pathlib import Path

import sglang_router  # noqa: F401  (the test extra installs it: a missing router fails, never skips)

from sidecar_emulator import fleet as F
from tests.conftest import maxq

SPEED = 20.0
# maxq-old: a prefill beyond ~225K tokens is larger than the lane can ever free (unfit_request).
UNFIT_TOKENS = 300_000


async def test_admission_answers_never_eject_a_lane_behind_the_real_router(tmp_path: Path) -> None:
    async with F.fleet(tmp_path) as f:
        engines, sets = await F.lanes(
            f, 2, "maxq-old", maxq(), SPEED, sidecars={"default": None, "router": F.ROUTER_ANSWERS}
        )
        results = {}
        for case, label, flags in (
            ("defaults", "default", []),
            ("router answers", "router", []),
            ("recommended flags", "default", F.RECOMMENDED_ROUTER_FLAGS),
        ):
            router = await f.router(f"router-{case.replace(' ', '-')}", [s.url for s in sets[label]], flags)
            await F.wait_ready(router, "/health")
            async with F.CrashWatch(engines) as watch:
                answers = await F.burst_then_small(router.url, unfit_tokens=UNFIT_TOKENS)
            results[case] = (F.summarize(answers), F.breaker_opens(router), sum(watch.crashes.values()))
            await f.stop(router)

    # The finding, reproduced: the sidecars' 503s open the breaker on both lanes; no small request served.
    summary, opens, crashes = results["defaults"]
    assert opens == 2, results
    assert summary["small_served"] == 0 and summary["small_statuses"] == {"503": 10}, summary
    assert crashes == 0  # nothing was wrong with either lane

    # The sidecar's answers for routers, the router at its defaults: every small request served.
    summary, opens, crashes = results["router answers"]
    assert (summary["small_served"], opens, crashes) == (10, 0, 0), results
    assert summary["unfit_statuses"] == {"413": 16} and summary["unfit_codes"] == {"unfit_request": 16}

    # The sidecar's default answers, the router with the recommended flags: every small request served,
    # and the client still gets the sidecar's own answer (not "no available workers").
    summary, opens, crashes = results["recommended flags"]
    assert (summary["small_served"], opens, crashes) == (10, 0, 0), results
    assert summary["unfit_statuses"] == {"503": 16} and summary["unfit_codes"] == {"unfit_request": 16}
