"""replay: the engine model and the live decision code in virtual time, deterministic for a seed."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from sidecar.policy.schema import load_policy_file
from sidecar.signals.engine import parse_loads, parse_metrics, parse_server_info
from sidecar_emulator.engine import EngineModel
from sidecar_emulator.exposition import FrontendMetrics, loads_json, render_metrics, server_info
from sidecar_emulator.profiles import get_profile
from sidecar_emulator.readings import engine_signals
from sidecar_emulator.replay import run_replay
from sidecar_emulator.scenario import ScenarioError, load_scenario, load_trace
from tests.conftest import ROOT

SCENARIOS = sorted((ROOT / "scenarios").glob("*.yaml"))


def replay(path: Path, gate: bool, seed: int | None = None) -> dict:
    sc = load_scenario(path)
    policy = load_policy_file(sc.policy_path(path.parent))
    return run_replay(
        sc, gate=gate, policy=policy, profile=get_profile(sc.profile), seed=sc.seed if seed is None else seed
    )


def test_the_shortcut_reads_what_the_scraper_would_parse() -> None:
    """replay skips HTTP; what it reads must equal what the live scraper parses from the emulator."""
    model = EngineModel(get_profile("maxq-old"), seed=1)
    model.submit("a", 120_000, max_new_tokens=64, now=0.0)
    model.submit("b", 90_000, max_new_tokens=64, now=0.0)
    for t in (1.0, 3.0, 7.5):
        model.advance(t)
        text, _ = render_metrics(model, FrontendMetrics())
        parsed = (
            parse_server_info(server_info(model))
            | parse_metrics(text.decode())
            | parse_loads(loads_json(model))
        )
        direct = asdict(engine_signals(model, t))
        # The fields the gate reads must come through the real parsers, not just agree when present.
        needed = {
            "running_requests",
            "queue_requests",
            "kv_available_tokens",
            "mamba_available_slots",
            "pending_prefill_tokens",
            "max_total_tokens",
            "chunked_prefill_size",
            "context_len",
        }
        assert needed <= set(parsed), needed - set(parsed)
        for field, value in parsed.items():
            if field in direct:
                assert direct[field] == pytest.approx(value), (t, field)
        assert parsed["queue_requests"] == direct["queue_requests"]


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_every_scenario_is_deterministic_and_accounts_for_every_request(path: Path) -> None:
    for gate in (False, True):
        first, second = replay(path, gate), replay(path, gate)
        assert json.dumps(first, sort_keys=True, default=str) == json.dumps(
            second, sort_keys=True, default=str
        )
        ended = {"completed", "failed"} | {
            o for o in (r["outcome"] for r in first["requests_detail"]) if o.startswith("rejected:")
        }
        assert all(r["outcome"] in ended for r in first["requests_detail"]), "a request has no outcome"
        if gate:
            assert first["ledger_at_end"] == 0


def test_outage_burst_crashes_the_ungated_engine_and_not_the_gated_one() -> None:
    path = ROOT / "scenarios" / "maxq-outage-burst.yaml"
    ungated, gated = replay(path, False), replay(path, True)
    assert len(ungated["crashes"]) >= 1 and "out of memory" in ungated["crashes"][0]["reason"]
    assert ungated["failed"] > 0
    assert gated["crashes"] == [] and gated["failed"] == 0
    assert gated["completed"] > ungated["completed"]
    # What the gate turned away, it turned away with a reason: the lane cannot prefill it at all.
    assert set(gated["rejected_by_reason"]) <= {"unfit_request"}


def test_mamba_lane_crashes_ungated_on_slots_not_memory() -> None:
    path = ROOT / "scenarios" / "mamba-slot-exhaustion.yaml"
    ungated, gated = replay(path, False), replay(path, True)
    assert "Can not alloc mamba cache" in ungated["crashes"][0]["reason"]
    assert gated["crashes"] == [] and gated["completed"] == 4
    assert any(k.startswith("hold/mamba_slots") for k in gated["decisions"])


def test_sustained_rounds_keep_their_throughput_under_the_gate() -> None:
    path = ROOT / "scenarios" / "sustained-rounds.yaml"
    ungated, gated = replay(path, False), replay(path, True)
    assert ungated["crashes"] == gated["crashes"] == []
    assert gated["completed"] == ungated["completed"] == 40
    assert gated["served_tokens"] == ungated["served_tokens"]


def test_a_different_seed_changes_the_run() -> None:
    path = ROOT / "scenarios" / "maxq-outage-burst.yaml"
    a, b = replay(path, True, seed=1), replay(path, True, seed=2)
    assert [r["prompt_tokens"] for r in a["requests_detail"]] != [
        r["prompt_tokens"] for r in b["requests_detail"]
    ]


def test_request_log_and_decision_log_traces(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    log.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"t": 0, "prompt_tokens": 50000, "max_new_tokens": 100},
                {"t": 1.5, "prompt_tokens": 60000, "max_new_tokens": 100, "priority": 2},
            ]
        )
        + "\n"
    )
    sc = load_trace(log, profile="maxq-old", policy="sidecar_emulator/policies/maxq-qwen3next-old.yaml")
    assert [r.t for r in sc.workload[0].requests] == [0, 1.5]

    decisions = tmp_path / "decisions.jsonl"
    decisions.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {
                    "ts": 1000.0,
                    "event": "decision",
                    "request_id": "x",
                    "decision": "hold",
                    "prompt_tokens": 70000,
                    "max_new_tokens": 10,
                    "priority": 0,
                },
                {
                    "ts": 1003.0,
                    "event": "decision",
                    "request_id": "x",
                    "decision": "admit",
                    "prompt_tokens": 70000,
                    "max_new_tokens": 10,
                    "priority": 0,
                },
                {
                    "ts": 1001.0,
                    "event": "decision",
                    "request_id": "y",
                    "decision": "admit",
                    "prompt_tokens": 1000,
                    "max_new_tokens": 10,
                    "priority": 0,
                },
            ]
        )
        + "\n"
    )
    sc = load_trace(decisions, profile="maxq-old", policy="sidecar_emulator/policies/maxq-qwen3next-old.yaml")
    assert [(r.t, r.prompt_tokens) for r in sc.workload[0].requests] == [(0.0, 70000), (1.0, 1000)]
    result = run_replay(
        sc,
        gate=True,
        policy=load_policy_file(ROOT / "sidecar_emulator/policies/maxq-qwen3next-old.yaml"),
        profile=get_profile("maxq-old"),
        seed=0,
    )
    assert result["completed"] == 2

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0, "prompt_tokens": 5}\n{"t": 1, "prompt_tokens": \n')
    with pytest.raises(ScenarioError, match=r"bad.jsonl:2: not JSON"):
        load_trace(bad, profile="maxq-old", policy="p")


def test_replay_command_prints_the_table_writes_json_and_a_readable_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "replay",
            "scenarios/mamba-slot-exhaustion.yaml",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "crashes" in r.stdout and "gated (mamba-lane)" in r.stdout
    data = json.loads(out.read_text())
    assert set(data) == {"ungated", "gated (mamba-lane)"}
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.shape[0] > 500 and img.shape[1] > 800


def test_replay_command_locates_scenario_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: x\nprofile: maxq-old\npolicy: sidecar_emulator/policies/maxq-qwen3next-old.yaml\nduration_s: 10\n"
        "workload:\n  - kind: burst\n    count: 0\n    interval_s: 1\n    prompt_tokens: [1, 2]\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "sidecar", "replay", str(bad)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 2
    assert f"{bad}:7: workload.0.burst.count" in r.stderr


def test_live_nvml_free_starves_a_caching_engine_and_the_idle_budget_does_not() -> None:
    """Why the Max-Q policies budget idle memory: PyTorch keeps NVML free at its low-water mark."""
    from sidecar.policy.schema import HeadroomSource

    path = ROOT / "scenarios" / "maxq-outage-burst.yaml"
    sc = load_scenario(path)
    # At calibrate's defaults (a 0.05 safety: margin 1.051; the 16 MiB reserve floor): the shipped policy's
    # 1.0 and 2 MiB (evidence D19) leave this burst enough room above the allocator's low-water mark,
    # which says nothing about a busier lane.
    shipped = load_policy_file(sc.policy_path(path.parent))
    budget = shipped.with_section("cost", margin=1.051).with_section("vram", reserve_bytes=16 * 2**20)
    nvml = budget.with_section("vram", headroom=HeadroomSource.NVML_FREE)
    on_nvml = run_replay(sc, gate=True, policy=nvml, profile=get_profile(sc.profile), seed=sc.seed)
    on_budget = run_replay(sc, gate=True, policy=budget, profile=get_profile(sc.profile), seed=sc.seed)
    assert on_nvml["crashes"] == on_budget["crashes"] == []
    assert on_nvml["rejected_by_reason"].get("hold_timeout", 0) > 0  # held until they gave up
    assert on_budget["rejected_by_reason"].get("hold_timeout", 0) == 0
    assert on_budget["completed"] > on_nvml["completed"]


def test_a_neighbour_growing_on_the_card_is_taken_out_of_the_budget() -> None:
    """Budget mode still reads the card live: another process's growth comes out of the headroom."""
    path = ROOT / "scenarios" / "noisy-neighbour.yaml"
    ungated, gated = replay(path, False), replay(path, True)
    assert "out of memory" in ungated["crashes"][0]["reason"]
    assert gated["crashes"] == [] and gated["failed"] == 0
    assert gated["decisions"].get("hold/vram_headroom", 0) >= 1
    held = [r for r in gated["requests_detail"] if r["held_s"] > 0]
    assert held and all(r["outcome"] == "completed" for r in held)


def test_outage_scenario_dies_in_the_incidents_state() -> None:
    """Ungated, the outage scenario crashes where the incident did (evidence I4, I5; free memory: D11)."""
    from sidecar_emulator.profiles import MiB
    from sidecar_emulator.replay import Driver

    sc = load_scenario(ROOT / "scenarios" / "maxq-outage-burst.yaml")
    driver = Driver(sc, get_profile(sc.profile), None, sc.seed)
    driver.run()
    crash = driver.engine.crashes[0]
    assert crash.requested_bytes == 560 * MiB and "out of memory" in crash.reason
    live = crash.live
    assert (live.num_running_reqs, live.num_queue_reqs) == (1, 14)
    assert live.pending_prefill_tokens == pytest.approx(1_485_849, rel=0.05)
    assert live.token_usage == 0.73 and live.mamba_usage == pytest.approx(0.06)
    assert live.kv_available_tokens > 100_000  # the pool was not full


def test_sustained_rounds_take_as_long_as_measured() -> None:
    """10 rounds of 4 x ~240K, 8,192 output tokens: 93-107 s a round (evidence M5)."""
    result = replay(ROOT / "scenarios" / "sustained-rounds.yaml", False)
    rounds: dict[str, list[dict]] = {}
    for r in result["requests_detail"]:
        rounds.setdefault(r["rid"].split("-")[0], []).append(r)
    assert len(rounds) == 10
    for recs in rounds.values():
        took = max(r["end"] for r in recs) - min(r["arrival"] for r in recs)
        assert 93 <= took <= 107, took
