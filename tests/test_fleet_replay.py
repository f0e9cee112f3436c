"""``replay --lanes``: a fleet behind a model of SGLang's routers (smg 1.13, sglang-router 0.3.2), in
virtual time.

The experiment of the fleet test on real processes (requests no lane can run, then small ones), in a
few seconds: the routers' retries and breakers turn the answers the sidecar gave before issue 26 (503)
into lane ejections; its defaults (413 unfit, 429 busy) behind smg, the recommended flags behind 0.3.2,
or a router that reads the fit signals, do not. tests/test_fleet_replay_live.py compares the model with
every live run."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar import cli
from sidecar.policy.schema import LoadedPolicy, Policy
from sidecar_emulator.fleet import ANSWERS_BEFORE_26, RECOMMENDED_ROUTER_FLAGS
from sidecar_emulator.fleet_replay import (
    ROUTER_DEFAULTS,
    ROUTER_RECOMMENDED,
    SMG_DEFAULTS,
    SMG_RECOMMENDED,
    Breaker,
    FleetDriver,
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
policy: sidecar_emulator/policies/maxq-qwen3next-old.yaml
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


def with_answers(loaded: LoadedPolicy, answers: dict) -> LoadedPolicy:  # type: ignore[type-arg]
    data = loaded.policy.model_dump() | {"answers": loaded.policy.answers.model_dump() | answers}
    return LoadedPolicy(Policy.model_validate(data), loaded.sha256, loaded.path)


# What the sidecar answered before issue 26: unfit and busy both 503.
BEFORE_26 = ANSWERS_BEFORE_26
UNFIT_429 = {"unfit_lane": {"status": 429, "retry_after": False, "should_retry": False}}


def lanes_with(answers: str | dict):  # type: ignore[no-untyped-def,type-arg]
    if answers == "policy":
        policy = maxq()
    elif answers == "router":
        policy = with_router_answers(maxq())
    else:
        assert isinstance(answers, dict)
        policy = with_answers(maxq(), answers)
    return lanes_from_count(2, get_profile("maxq-old"), policy)


def fleet(scenario, *, gated: bool, rule: str, flags: RouterFlags, answers: str | dict = "policy", **kw):  # type: ignore[no-untyped-def,type-arg]
    lanes = lanes_with(answers)
    r = run_fleet(scenario, lanes, gated=gated, rule=rule, flags=flags, seed=scenario.seed, **kw)
    # Every request ends in exactly one outcome, and the sidecars' ledgers return to zero.
    assert r["completed"] + r["client_errors"] == r["requests"] and r["in_flight_at_end"] == 0
    assert r["ledger_at_end"] == 0
    return r


def small_served(r) -> int:  # type: ignore[no-untyped-def]
    return sum(
        1 for q in r["requests_detail"] if q["prompt_tokens"] < 300_000 and q["outcome"] == "completed"
    )


@pytest.mark.parametrize("flags", [ROUTER_DEFAULTS, SMG_DEFAULTS])
def test_the_answers_before_issue_26_eject_healthy_lanes_behind_both_routers(scenario, flags) -> None:  # type: ignore[no-untyped-def]
    r = fleet(
        scenario, gated=True, rule="round_robin", flags=flags, answers=BEFORE_26, body_bytes_per_token=3
    )
    assert r["crashes"] == []  # nothing was wrong with either lane...
    assert r["breaker_ejections"] == 2 and r["health_ejections"] == 0  # ...and the router ejected both
    assert r["router_retries"] >= 10  # each unrunnable request tried on lane after lane (503 is retried)
    assert small_served(r) < 10


@pytest.mark.parametrize(
    "answers, flags, rule",
    [
        ("policy", SMG_DEFAULTS, "round_robin"),  # 413: not retried, a success for smg's breaker
        ("policy", SMG_DEFAULTS, "least_load"),
        ("policy", SMG_DEFAULTS, "hash"),  # every request on one lane: still a success each
        ("policy", SMG_RECOMMENDED, "random"),
        (UNFIT_429, SMG_DEFAULTS, "round_robin"),  # 429: retried elsewhere, neutral for smg's breaker
        ("router", ROUTER_DEFAULTS, "round_robin"),  # 413: not retried; 6 failures a lane, under 10
        ("policy", ROUTER_RECOMMENDED, "round_robin"),  # breaker off, /readyz ejects dead engines only
        ("router", ROUTER_RECOMMENDED, "least_load"),
        ("policy", ROUTER_DEFAULTS, "fit"),  # the router itself knows no lane can run them
    ],
)
def test_the_recommended_answers_flags_or_fit_rule_eject_nothing(scenario, answers, flags, rule) -> None:  # type: ignore[no-untyped-def]
    r = fleet(scenario, gated=True, rule=rule, flags=flags, answers=answers, body_bytes_per_token=3)
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
    cmd = ["replay", str(path), "--gate", "on", "--answers", "router", "--gateway", "sglang-router"]
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


def test_retry_max_retries_is_attempts_in_all_on_both_routers(scenario) -> None:  # type: ignore[no-untyped-def]
    """``--retry-max-retries 5``: 5 attempts in all (measured: 32 unfit 429s, 160 attempts, 128
    retries), not 1 + 5. The breaker off, every unrunnable request is tried 5 times."""
    for flags in (ROUTER_RECOMMENDED, SMG_RECOMMENDED):
        r = fleet(
            scenario, gated=True, rule="round_robin", flags=flags, answers=BEFORE_26, body_bytes_per_token=3
        )
        assert r["router_retries"] == 12 * 4, (flags.name, r["router_retries"])
    assert RouterFlags.from_args("x", ["--disable-retries"], SMG_DEFAULTS).attempts == 1


def test_smg_never_retries_a_body_over_1_mib_but_its_503_still_counts(scenario) -> None:  # type: ignore[no-untyped-def]
    lanes = lanes_with(BEFORE_26)
    for per_token, retried in ((3.0, True), (4.0, False)):  # 300K tokens: 0.86 MiB, then 1.14 MiB
        d = FleetDriver(
            scenario,
            lanes,
            gated=True,
            rule="round_robin",
            flags=SMG_RECOMMENDED,
            seed=5,
            body_bytes_per_token=per_token,
        )
        r = d.run()
        assert (r["router_retries"] > 0) is retried
    on = FleetDriver(
        scenario, lanes, gated=True, rule="round_robin", flags=SMG_DEFAULTS, seed=5, body_bytes_per_token=4.0
    )
    r = on.run()
    # 6 unretried 503s a lane, each a failure: under the threshold of 10, so no lane is out.
    assert r["router_retries"] == 0 and r["breaker_ejections"] == 0
    assert [lane.breaker.failures for lane in on.lanes] == [0, 0]  # the small ones' successes reset it


def test_which_answers_count_for_each_routers_breaker() -> None:
    assert [SMG_DEFAULTS.breaker_outcome(s) for s in (200, 400, 413, 429, 503, 408)] == [
        True,
        True,
        True,
        None,
        False,
        False,
    ]
    assert [ROUTER_DEFAULTS.breaker_outcome(s) for s in (200, 413, 429, 503)] == [True, False, False, False]
    b = Breaker(SMG_DEFAULTS)
    for _ in range(50):
        b.record(SMG_DEFAULTS.breaker_outcome(429), 0.0)
    assert b.state == "closed" and b.failures == 0


def test_smg_leaves_out_overloaded_and_wedged_lanes_while_another_is_left(scenario) -> None:  # type: ignore[no-untyped-def]
    d = FleetDriver(
        scenario, lanes_with("policy"), gated=True, rule="round_robin", flags=SMG_DEFAULTS, seed=5
    )
    a, b = d.lanes
    a.loads, b.loads = (0, 0.1, 8), (0, 0.1, 7)  # 8 waiting (held requests included): vetoed
    assert d.candidates() == [b]
    b.loads = (0, 0.8, 0)  # KV usage 0.8: vetoed too; every lane over: none is left out
    assert d.candidates() == [a, b]
    a.loads = b.loads = (0, 0.1, 0)
    a.in_flight, a.in_flight_tokens, a.last_progress = 4, 1000, 0.0
    d.t = 2.9
    assert d.candidates() == [a, b]
    d.t = 3.0  # four in flight, no answer for 3 s: wedged, out until it answers
    assert d.candidates() == [b]
    a.in_flight_tokens = 400_000  # the bound stretches to the prefill time in flight (200 s here)
    assert d.candidates() == [a, b]
    off = RouterFlags.from_args("x", ["--disable-worker-overload-protection"], SMG_DEFAULTS)
    assert (off.overload_waiting, off.overload_usage) == (None, None)
    assert SMG_DEFAULTS.slowed(20).cb_timeout_s == 1200 and SMG_DEFAULTS.slowed(20).loads_poll_s == 200
