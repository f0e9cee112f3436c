"""Fleets in virtual time (``replay --lanes``): which routing rule, which answers and router flags, how
many lanes. Deterministic (seeded), seconds per run, nothing but this process.

Three experiments, each a table in ``bench/results/fleet-replay.md`` (rows also in ``fleet-replay.json``):

1. ``scenarios/fleet/unfit-burst.yaml`` on 2 Max-Q lanes (the experiment ``bench/fleet.py`` runs on real
   processes): every setup (router alone; sidecars with the policy's answers or docs/routing.md's router
   answers; the router at its defaults or with the recommended flags) under every rule.
2. The same traffic on two lanes that are not alike (``scenarios/fleet/maxq-and-h200.fleet.yaml``: a
   Max-Q lane that cannot run 300K-token prompts, an H200 that can), sidecars only.
3. ``scenarios/fleet/night.yaml`` (chat, growing agents, long requests) on 1 to 4 Max-Q lanes, each rule,
   router alone and sidecars with router answers and the recommended flags: how many lanes?

    .venv/bin/python bench/fleet_replay.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sidecar.policy.schema import load_policy_file  # noqa: E402
from sidecar_emulator import fleet_replay as FR  # noqa: E402
from sidecar_emulator.profiles import get_profile  # noqa: E402
from sidecar_emulator.scenario import load_scenario  # noqa: E402

FLEET = ROOT / "scenarios" / "fleet"
RESULTS = ROOT / "bench" / "results"


def experiment(title: str, scenario: Path, fleets: list[list[FR.LaneSetup]], plan: list[FR.Setup]) -> dict:
    sc = load_scenario(scenario)
    started = time.monotonic()
    rows = FR.sweep(sc, fleets, plan, sc.seed)
    took = time.monotonic() - started
    print(f"\n## {title}\n{FR.format_fleet_table(rows)}\n({len(rows)} runs, {took:.0f} s)", flush=True)
    return {
        "title": title,
        "scenario": str(scenario.relative_to(ROOT)),
        "seconds": round(took, 1),
        "rows": rows,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="experiment 3 on 1 and 2 lanes only")
    args = ap.parse_args()
    policy = load_policy_file(ROOT / "sidecar_emulator" / "policies" / "maxq-qwen3next-old.yaml")
    maxq = get_profile("maxq-old")
    rules = list(FR.RULES)
    out = [
        experiment(
            "1. Requests no lane can run, during chat, then small requests: 2 Max-Q lanes",
            FLEET / "unfit-burst.yaml",
            [FR.lanes_from_count(2, maxq, policy)],
            FR.setups("both", "both", "both", rules),
        ),
        experiment(
            "2. The same on two unlike lanes (Max-Q + H200), sidecars",
            FLEET / "unfit-burst.yaml",
            [FR.load_fleet(FLEET / "maxq-and-h200.fleet.yaml", "maxq-old", policy)],
            FR.setups("on", "both", "both", rules),
        ),
        experiment(
            "3. A night of traffic on 1-4 Max-Q lanes (router answers, recommended flags)",
            FLEET / "night.yaml",
            [FR.lanes_from_count(n, maxq, policy) for n in ((1, 2) if args.quick else (1, 2, 3, 4))],
            FR.setups("both", "router", "recommended", rules),
        ),
    ]
    RESULTS.mkdir(exist_ok=True)
    slim: list[dict[str, Any]] = [
        e | {"rows": [{k: v for k, v in r.items() if k != "requests_detail"} for r in e["rows"]]} for e in out
    ]
    (RESULTS / "fleet-replay.json").write_text(json.dumps(slim, indent=1, sort_keys=True, default=str) + "\n")
    md = [
        "# Fleets in virtual time (`bench/fleet_replay.py`)",
        "",
        f"`.venv/bin/python bench/fleet_replay.py{' --quick' if args.quick else ''}`.",
        "",
        "`replay --lanes` (sidecar_emulator/fleet_replay.py): lanes of the engine model, each with the sidecar's"
        " gate or without, behind a model of SGLang's routers (408/429/5xx retried, 5 attempts in all; breaker 10"
        " consecutive failures / 60 s; health checks; smg's breaker classes, retry cut, polls and veto; evidence"
        " S19, F261-F265). Goodput: served tokens over the run's"
        " own span; makespan: when the last request ended; client errors: answers that were not a completed"
        " stream (a client that retries counts each attempt); ejections: breaker openings plus health-check"
        " ejections; no worker: the router's own 503 with every lane out.",
    ]
    for e in out:
        md += [
            "",
            f"## {e['title']}",
            "",
            f"`{e['scenario']}`, {len(e['rows'])} runs in {e['seconds']:.0f} s.",
            "",
        ]
        md.append(FR.format_fleet_table(e["rows"], markdown=True))
    (RESULTS / "fleet-replay.md").write_text("\n".join(md) + "\n")
    print(f"\nwrote {RESULTS / 'fleet-replay.md'} and fleet-replay.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
