"""``replay --lanes``: a fleet behind a model of SGLang's router, in virtual time.

The experiment of the fleet test on real processes (requests no lane can run, then small ones), in a
few seconds: the router's retries and breaker turn the sidecars' default answers into lane ejections;
docs/routing.md's answers, its recommended flags, or a router that reads the fit signals, do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar import cli
from sidecar_emulator.fleet import RECOMMENDED_ROUTER_FLAGS
from sidecar_emulator.fleet_replay import (
    ROUTER_DEFAULTS,
    ROUTER_RECOMMENDED,
    Breaker,
    RouterFlags,
    lanes_from_count,
    run_fleet,
    with_router_answers,
)
from sidecar_emulator.profiles import get_profile
from sidecar_emulator.scenario import load_scenario
from tests.conftest import ROOT, maxq

# 12 requests no Max-Q lane can ever run (300K tokens), 4 a second, then 10 small ones.
SCENARIO = """
name: unfit-then-small
profile: maxq-old
policy: policies/maxq-qwen3next-old.yaml
seed: 5
duration_s: 600
retry_after_default_s: 5
workload:
  - {kind: burst, count: 12, start_s: 1, interval_s: 0.25, prompt_tokens: [300000, 300000], max_new_tokens: 16}
  - {kind: burst, count: 10, start_s: 8, interval_s: 0.5, prompt_tokens: [500, 2000], max_new_tokens: 16}
"""


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("fleet") / "unfit-then-small.yaml"
    path.write_text(SCENARIO)
    return load_scenario(path)


def fleet(scenario, *, gated: bool, rule: str, flags: RouterFlags, answers: str = "policy"):  # type: ignore[no-untyped-def]
    policy = maxq() if answers == "policy" else with_router_answers(maxq())
    lanes = lanes_from_count(2, get_profile("maxq-old"), policy)
    r = run_fleet(scenario, lanes, gated=gated, rule=rule, flags=flags, seed=scenario.seed)
    # Every request ends in exactly one outcome, and the sidecars' ledgers return to zero.
    assert r["completed"] + r["client_errors"] == r["requests"] and r["in_flight_at_end"] == 0
    assert r["ledger_at_end"] == 0
    return r


def small_served(r) -> int:  # type: ignore[no-untyped-def]
    return sum(
        1 for q in r["requests_detail"] if q["prompt_tokens"] < 300_000 and q["outcome"] == "completed"
    )


def test_default_answers_at_the_routers_defaults_eject_healthy_lanes(scenario) -> None:  # type: ignore[no-untyped-def]
    r = fleet(scenario, gated=True, rule="round_robin", flags=ROUTER_DEFAULTS)
    assert r["crashes"] == []  # nothing was wrong with either lane...
    assert r["breaker_opens"] == 2 and r["health_ejections"] == 0  # ...and the router ejected both
    assert r["router_retries"] >= 10  # each unrunnable request tried on lane after lane (503 is retried)
    assert r["router_unavailable"] > 0 and small_served(r) < 10


@pytest.mark.parametrize(
    "answers, flags, rule",
    [
        ("router", ROUTER_DEFAULTS, "round_robin"),  # 413: not retried, one failure each
        ("policy", ROUTER_RECOMMENDED, "round_robin"),  # breaker off, /readyz ejects dead engines only
        ("router", ROUTER_RECOMMENDED, "least_load"),
        ("policy", ROUTER_DEFAULTS, "fit"),  # the router itself knows no lane can run them
    ],
)
def test_the_recommended_answers_flags_or_fit_rule_eject_nothing(scenario, answers, flags, rule) -> None:  # type: ignore[no-untyped-def]
    r = fleet(scenario, gated=True, rule=rule, flags=flags, answers=answers)
    assert r["crashes"] == [] and r["breaker_opens"] == 0 and r["health_ejections"] == 0
    assert small_served(r) == 10 and r["router_unavailable"] == 0
    if rule == "fit":  # no lane heard of the unrunnable requests at all
        assert r["router_refused"] == 12 and r["router_retries"] == 0


def test_without_sidecars_the_unrunnable_requests_kill_the_engines(scenario) -> None:  # type: ignore[no-untyped-def]
    r = fleet(scenario, gated=False, rule="round_robin", flags=ROUTER_RECOMMENDED)
    assert len(r["crashes"]) == 2 and small_served(r) < 10


def test_the_breaker_opens_on_consecutive_failures_and_closes_after_half_open_successes() -> None:
    b = Breaker(ROUTER_DEFAULTS)
    for _ in range(9):
        b.record(False, 0.0)
    b.record(True, 0.0)  # a success resets the count: failures must be consecutive
    for _ in range(9):
        b.record(False, 1.0)
    assert b.can_execute(1.0)
    b.record(False, 1.0)
    assert not b.can_execute(60.9) and b.opens == 1
    assert b.can_execute(61.0) and b.state == "half_open"
    b.record(False, 61.0)  # one failure half-open reopens it
    assert b.opens == 2 and not b.can_execute(61.0)
    assert b.can_execute(121.0)
    for _ in range(3):
        b.record(True, 121.0)
    assert b.state == "closed"
    off = Breaker(ROUTER_RECOMMENDED)
    for _ in range(100):
        off.record(False, 0.0)
    assert off.can_execute(0.0) and off.opens == 0


def test_the_recommended_flags_are_read_from_the_list_the_readme_prints() -> None:
    f = RouterFlags.from_args("x", RECOMMENDED_ROUTER_FLAGS)
    assert (f.breaker, f.health_endpoint, f.health_interval_s, f.health_failure_threshold) == (
        False,
        "/readyz",
        5.0,
        2,
    )
    with pytest.raises(ValueError, match="not modelled"):
        RouterFlags.from_args("x", ["--policy", "cache_aware"])


def test_cli_compares_lane_counts_and_rules_and_says_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO)
    cmd = ["replay", str(path), "--gate", "on", "--answers", "router"]
    rc = cli.main([*cmd, "--lanes", "1,2", "--router", "round_robin,fit", "--router-flags", "defaults"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if line.startswith("sidecars")]
    assert len(rows) == 4 and "ejections" in out
    assert cli.main([*cmd, "--lanes", "two"]) == 2 and "--lanes two" in capsys.readouterr().err
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text("lanes:\n  - {profile: maxq-old}\n  - {profile: no-such-lane}\n")
    assert cli.main([*cmd, "--lanes", str(fleet_file)]) == 2
    assert "lanes[1].profile" in capsys.readouterr().err
    typo = tmp_path / "typo.yaml"
    typo.write_text("lanes:\n  - {profile: maxq-old, polcy: x.yaml}\n")
    assert cli.main([*cmd, "--lanes", str(typo)]) == 2
    err = capsys.readouterr().err
    assert "polcy" in err and ":2" in err, err


def test_the_shipped_fleet_file_loads() -> None:
    from sidecar_emulator.fleet_replay import load_fleet

    lanes = load_fleet(ROOT / "scenarios" / "fleet" / "maxq-and-h200.fleet.yaml", "maxq-old", maxq())
    assert [(lane.name, lane.profile.name) for lane in lanes] == [
        ("maxq", "maxq-old"),
        ("h200", "h200-qwen3next"),
    ]
