"""``replay --lanes`` against the live runs: every case ``bench/fleet_routers.py`` ran on real processes
(smg 1.13.0 and sglang-router 0.3.2 in front of emulated lanes and their sidecars), replayed in virtual
time, must predict the same lane ejections and the same number of small requests served.

The live fleet runs its emulators at ``--speed 20`` while the routers keep wall-clock timers, so the model
runs with the router's clocks slowed by the same factor (``RouterFlags.slowed``) and the sidecars' policy
unscaled (the live sidecars' clocks are scaled to the emulator's). Bodies are the live clients': compact
``input_ids``, 3 bytes a token (300K tokens: 0.86 MiB, under smg's 1 MiB retry cut). Live draws whose
lanes left by the health check alone (``health_out``: the sidecar's signals went stale on a starved
machine) are reported, not replayed: the model has no CPU starvation.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from sidecar.policy.schema import LoadedPolicy, Policy
from sidecar_emulator.fleet import ANSWERS_BEFORE_26, RECOMMENDED_ROUTER_FLAGS
from sidecar_emulator.fleet_replay import (
    ROUTER_DEFAULTS,
    SMG_DEFAULTS,
    RouterFlags,
    lanes_from_count,
    run_fleet,
)
from sidecar_emulator.profiles import get_profile
from sidecar_emulator.scenario import load_scenario
from tests.conftest import ROOT, maxq

LIVE = ROOT / "bench" / "results" / "fleet-routers.json"
SPEED = 20.0
# Each live routing policy as the replay's rule: requests here share one prefix ([11] * n), so the
# hashing policies send them all to one lane; power_of_two on equal loads picks at random.
RULE_OF = {
    "round_robin": "round_robin",
    "random": "random",
    "power_of_two": "random",
    "least_load": "least_load",
    "cache_aware": "hash",
    "consistent_hashing": "hash",
    "prefix_hash": "hash",
}
BEFORE_26 = ANSWERS_BEFORE_26


def flags_of(row: dict[str, Any]) -> RouterFlags:
    smg = row["router"].startswith("smg")
    base = SMG_DEFAULTS if smg else ROUTER_DEFAULTS
    settings = row["settings"]
    if settings == "documented flags":
        base = RouterFlags.from_args(settings, RECOMMENDED_ROUTER_FLAGS, base)
    elif settings == "defaults, overload veto off":
        base = RouterFlags.from_args(settings, ["--disable-worker-overload-protection"], base)
    return base.slowed(SPEED)


def policy_of(row: dict[str, Any]) -> LoadedPolicy:
    loaded = maxq()
    if row["answers"] == "defaults":
        return loaded
    data = loaded.policy.model_dump() | {"answers": loaded.policy.answers.model_dump() | BEFORE_26}
    return LoadedPolicy(Policy.model_validate(data), loaded.sha256, loaded.path)


def scenario_text(row: dict[str, Any]) -> str:
    """The live workload in the engine's seconds: the unfit burst 8 at a time, (a chat load 6 at a time,)
    then 10 small requests one after another once the rest is answered."""
    rounds = row["n_unfit"] // 8
    work = [
        f"  - {{kind: rounds, rounds: {rounds}, per_round: 8, prompt_tokens: [300000, 300000], "
        "max_new_tokens: 8, retries: 0}"
    ]
    small_at = 60
    if row["case"] == "mixed":
        work.append(
            "  - {kind: rounds, rounds: 7, per_round: 6, prompt_tokens: [1000, 40000], max_new_tokens: 32, "
            "retries: 0}"
        )
        small_at = 400
    work.append(
        f"  - {{kind: rounds, rounds: 10, per_round: 1, start_s: {small_at}, prompt_tokens: [100, 100], "
        "max_new_tokens: 8, retries: 0}"
    )
    return (
        "name: live-case\nprofile: maxq-old\npolicy: policies/maxq-qwen3next-old.yaml\nseed: 7\n"
        "duration_s: 1200\nretry_after_default_s: 5\nworkload:\n" + "\n".join(work) + "\n"
    )


def live_cases() -> list[dict[str, Any]]:
    return json.loads(LIVE.read_text())


def key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (
        row["router"],
        row["settings"],
        row["answers"],
        row["lanes"],
        row["n_unfit"],
        row["case"],
        RULE_OF[row["policy"]],
    )


@cache
def _replay(k: tuple[Any, ...], tmp: str) -> dict[str, Any]:
    row = dict(zip(("router", "settings", "answers", "lanes", "n_unfit", "case", "rule"), k, strict=True))
    path = Path(tmp) / f"{abs(hash(k))}.yaml"
    path.write_text(scenario_text(row))
    lanes = lanes_from_count(row["lanes"], get_profile("maxq-old"), policy_of(row))
    r = run_fleet(
        load_scenario(path),
        lanes,
        gated=True,
        rule=row["rule"],
        flags=flags_of(row),
        seed=7,
        body_bytes_per_token=3.0,
    )
    assert r["completed"] + r["client_errors"] == r["requests"] and r["ledger_at_end"] == 0
    small = [q for q in r["requests_detail"] if q["prompt_tokens"] == 100]
    return {
        "ejections": r["breaker_ejections"] + r["health_ejections"],
        "small_served": sum(1 for q in small if q["outcome"] == "completed"),
        "retries": r["router_retries"],
    }


def test_the_replay_predicts_every_live_case_of_both_routers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    rows = live_cases()
    assert {r["router"] for r in rows} == {"smg 1.13.0", "sglang-router 0.3.2"}
    tmp = str(tmp_path_factory.mktemp("live"))
    wrong = []
    for row in rows:
        if row.get("health_out"):
            continue  # its lanes went out by the health check on a starved machine: see below
        got = _replay(key(row), tmp)
        if (got["ejections"], got["small_served"]) != (row["ejections"], row["small_served"]):
            wrong.append(
                (key(row), row.get("repeat"), {"live": (row["ejections"], row["small_served"])}, got)
            )
    assert not wrong, "\n".join(map(str, wrong))


def test_the_live_acceptance_holds_in_the_results() -> None:
    """The sidecar's defaults behind smg at its defaults, and behind 0.3.2 with the documented flags:
    no lane ejected and every small request served, in every live burst case and mixed load."""

    def accepted(r: dict[str, Any]) -> bool:
        if r["answers"] != "defaults":
            return False
        return r["router"].startswith("smg") or r["settings"] == "documented flags"

    rows = [r for r in live_cases() if accepted(r)]
    # A draw whose lanes left the rotation by the health check (no breaker opened), which the replay does
    # not model: 0.3.2's documented flags check the sidecar's /readyz every 5 s and take a lane out
    # after 2 failures, and /readyz fails while the signals are older than 0.25 s (the policy's 5 s at
    # --speed 20), as they were on this shared 2-core machine under load. smg is never among them.
    disturbed = [r for r in rows if r.get("health_out")]
    assert all(r["settings"] == "documented flags" and r["ejections"] == 0 for r in disturbed), disturbed
    rows = [r for r in rows if not r.get("health_out")]
    assert rows
    for r in rows:
        assert (r["ejections"], r["small_served"]) == (0, 10), r
        if r["case"] == "mixed":
            assert r["chat_served"] == r["chat_sent"], r
    smg_policies = {r["policy"] for r in rows if r["router"].startswith("smg") and r["case"] == "burst"}
    assert len(smg_policies) == 7 and {r["lanes"] for r in rows} == {2, 4}
    assert {r["n_unfit"] for r in rows if r["case"] == "burst"} == {16, 32}
