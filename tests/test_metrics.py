"""Metric semantics: every counter sums to what it names, and promtool finds nothing to lint."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MIB
from tests.harness import FakeEngine, eventually, gen, lane, write_gpu_file
from tests.tools import run_tool

P = "sglang_sidecar_"


def samples(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """name -> {sorted labels: value}, read with the real prometheus-client parser."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name][tuple(sorted(s.labels.items()))] = s.value
    return out


def total(series: dict[tuple[tuple[str, str], ...], float]) -> float:
    return sum(series.values())


async def test_counters_sum_to_requests_and_held_requests_decide_once(tmp_path: Path) -> None:
    """Three held (one leaves, two admitted later), one queue_full, one unfit: 5 requests, 4 final
    decisions, 3 held. A held-then-admitted request is one admit, not a hold plus an admit."""
    engine = FakeEngine(events=1)
    async with (
        lane(tmp_path, engine, free_mib=0, hold__max_held=3) as (url, app, gpu_file),
        httpx.AsyncClient(timeout=10) as client,
    ):
        held = [
            asyncio.create_task(client.post(url + "/generate", json=gen(stream=True, rid=f"h{i}")))
            for i in range(3)
        ]
        await eventually(lambda: app.admission.held == 3)
        full = await client.post(url + "/generate", json=gen(rid="full"))
        assert full.headers["x-admission-reason"] == "queue_full"
        unfit = await client.post(url + "/generate", json=gen(tokens=200_000, rid="unfit"))
        assert unfit.headers["x-admission-reason"] == "unfit_request"
        held[0].cancel()
        await eventually(lambda: app.admission.held == 2)
        write_gpu_file(gpu_file, 1024 * MIB)
        for t in held[1:]:
            assert (await t).status_code == 200
        await eventually(lambda: app.admission.ledger.totals.requests == 0)
        m = samples((await client.get(url.admin + "/metrics")).text)

    requests, decisions = m[P + "requests_total"], m[P + "decisions_total"]
    assert total(requests) == 5
    assert requests[(("outcome", "completed"),)] == 2
    assert requests[(("outcome", "rejected"),)] == 2
    assert requests[(("outcome", "client_gone"),)] == 1
    # One final decision per request that got one (the leaver got none).
    assert total(decisions) == 4
    assert decisions[(("decision", "admit"), ("reason", "none"))] == 2
    assert decisions[(("decision", "reject"), ("reason", "queue_full"))] == 1
    assert decisions[(("decision", "reject"), ("reason", "unfit_request"))] == 1
    # Only possible pairs exist: no hold decision, no reason-less reject, no admit with a reason.
    for labels in decisions:
        d = dict(labels)
        assert d["decision"] in ("admit", "reject")
        assert (d["decision"] == "admit") == (d["reason"] == "none"), d
    assert m[P + "held_total"][(("check", "vram_headroom"), ("reason", "vram_headroom"))] == 3
    assert total(m[P + "held_total"]) == 3
    # hold_seconds observes every final decision: its count is the decisions' sum.
    assert m[P + "hold_seconds_count"][()] == total(decisions)
    assert m[P + "upstream_first_byte_seconds_count"][()] == 2
    assert m[P + "upstream_first_byte_seconds_sum"][()] > 0


async def test_shadow_mode_counts_what_enforcement_would_do_once_per_request(tmp_path: Path) -> None:
    async with (
        lane(tmp_path, FakeEngine(events=1), free_mib=0, app_kwargs={"mode_shadow": True}) as (url, _, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        assert (await client.post(url + "/generate", json=gen(stream=False))).status_code == 200
        m = samples((await client.get(url.admin + "/metrics")).text)
    assert m[P + "held_total"][(("check", "vram_headroom"), ("reason", "vram_headroom"))] == 1
    assert total(m[P + "decisions_total"]) == 1 == total(m[P + "requests_total"])
    assert m[P + "decisions_total"][(("decision", "admit"), ("reason", "none"))] == 1


async def test_build_info_process_metrics_and_renamed_gauges(tmp_path: Path) -> None:
    async with lane(tmp_path, FakeEngine()) as (url, _, _), httpx.AsyncClient(timeout=10) as client:
        m = samples((await client.get(url.admin + "/metrics")).text)
    (labels,) = m[P + "build_info"]
    assert dict(labels)["version"] not in ("", "unknown") and m[P + "build_info"][labels] == 1
    assert m["process_resident_memory_bytes"][()] > 0
    assert m["process_start_time_seconds"][()] > 0
    assert (("pool", "full"),) in m[P + "engine_token_usage_ratio"]
    assert m[P + "signal_consecutive_failures"][(("signal", "engine"),)] == 0
    assert m[P + "policy_last_reload_successful"][()] == 1
    # The policy's limits, for dashboards and alerts (the test lane's numbers).
    assert m[P + "policy_reserve_bytes"][()] == 0
    assert m[P + "policy_max_usage_ratio"] == {(("pool", "full"),): 1.0}  # no mamba section: no series
    assert m[P + "policy_engine_queue_max_requests"][()] == 1000
    assert m[P + "policy_signal_max_age_seconds"][(("signal", "engine"),)] == 5
    assert m[P + "policy_hold_max_requests"][()] == 10 and m[P + "policy_hold_max_wait_seconds"][()] == 30
    for old in ("engine_token_usage", "signal_failures"):
        assert P + old not in m


async def test_promtool_check_metrics_on_live_metrics_is_clean(tmp_path: Path) -> None:
    """After traffic of every kind, so that every family has samples to lint."""
    engine = FakeEngine(events=1)
    async with (
        lane(tmp_path, engine, free_mib=0, hold__max_held=1) as (url, app, gpu_file),
        httpx.AsyncClient(timeout=10) as client,
    ):
        task = asyncio.create_task(client.post(url + "/generate", json=gen(stream=False, rid="held")))
        await eventually(lambda: app.admission.held == 1)
        assert (await client.post(url + "/generate", json=gen(rid="x"))).status_code == 429
        write_gpu_file(gpu_file, 1024 * MIB)
        assert (await task).status_code == 200
        text = (await client.get(url.admin + "/metrics")).text
    r = run_tool("promtool", "check", "metrics", timeout=30, stdin_text=text)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr
    # The linter is really looking: a counter without `_total` is reported.
    bad = run_tool(
        "promtool", "check", "metrics", stdin_text="# HELP x_calls c\n# TYPE x_calls counter\nx_calls 1\n"
    )
    assert bad.returncode != 0 and "_total" in bad.stdout + bad.stderr


async def test_operate_metrics_section_names_every_exported_metric(tmp_path: Path) -> None:
    async with lane(tmp_path, FakeEngine()) as (url, _, _), httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(url.admin + "/metrics")).text
    page = (Path(__file__).resolve().parent.parent / "docs" / "operate.md").read_text()
    section = page.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    for family in text_string_to_metric_families(text):
        # `_created` is prometheus-client's creation-time companion of each counter and histogram.
        if family.name.startswith(P) and not family.name.endswith("_created"):
            name = family.name.removeprefix(P)
            shown = name + "_total" if family.type == "counter" else name
            assert f"`{shown}`" in section or f"`{shown}{{" in section, (
                f"docs/operate.md Metrics lacks {shown}"
            )


def test_the_policys_idle_figure_is_exported_only_when_it_states_one() -> None:
    """The dashboard sets the measured idle figure against the policy's: a policy with a figure
    exports it, one that says `auto` (or none) exports nothing rather than a 0."""
    from sidecar.ops.telemetry import policy_limits
    from sidecar.policy.in_force import rules_of
    from sidecar.policy.schema import load_policy_file
    from tests.conftest import ROOT

    def idle(policy: object) -> list[float]:
        return [
            s.value
            for fam in policy_limits(rules_of(policy))  # type: ignore[arg-type]
            for s in fam.samples
            if "idle_free" in s.name
        ]

    old = load_policy_file(ROOT / "policies" / "maxq-qwen3next-old.yaml").policy
    assert idle(old) == [float(old.vram.idle_free_bytes)]  # type: ignore[arg-type]
    auto = old.model_copy(update={"vram": old.vram.model_copy(update={"idle_free_bytes": "auto"})})
    assert idle(auto) == []


def test_each_kind_of_hold_names_itself_in_held_total() -> None:
    """Three holds share the reason ``vram_headroom`` (the headroom, the batch join, a pending join,
    and a prefill on its own schedule); the ``check`` label tells them apart, and a request held behind
    an earlier one says ``strict_order``."""
    from prometheus_client import CollectorRegistry

    from sidecar.core import demand
    from sidecar.core.decision import Action, Decision, Reason
    from sidecar.core.ledger import LedgerTotals
    from sidecar.ops.telemetry import Telemetry
    from sidecar.policy.in_force import rules_of
    from tests.conftest import small_policy

    registry = CollectorRegistry()
    t = Telemetry(registry)
    d = demand.build(rules_of(small_policy().policy), 10, arrived_at=0.0)
    for check in (
        "vram_headroom",
        "batch_join",
        "join_pending",
        "own_schedule",
        "strict_order",
        "join_pending",
    ):
        t.decision(Decision(Action.HOLD, Reason.VRAM_HEADROOM, check=check), d, 0.0, LedgerTotals())
    t.decision(Decision(Action.HOLD, Reason.KV_POOL, check="strict_order"), d, 0.0, LedgerTotals())

    def held(reason: str, check: str) -> float | None:
        return registry.get_sample_value(P + "held_total", {"reason": reason, "check": check})

    assert [
        held("vram_headroom", c) for c in ("vram_headroom", "batch_join", "join_pending", "own_schedule")
    ] == [
        1,
        1,
        2,
        1,
    ]
    assert held("vram_headroom", "strict_order") == 1 and held("kv_pool", "strict_order") == 1
    assert held("kv_pool", "kv_pool") == 0  # each reason's own check exists from the start
