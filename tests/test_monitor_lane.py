"""The lane watch end to end: the acceptance run in replay (virtual time) and the live sidecar.

A policy calibrated on the unperturbed engine, the engine's transients then 1.2x larger: the monitor
reports the first request and its margin stops the crash. The live sidecar over HTTP (a fake engine, a
GPU file) for `/admission/state`, `/admission/explain` and `/metrics`; `check-policy` with `auto`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar_emulator.probe_lane import perturbed
from sidecar_emulator.profiles import get_profile
from sidecar_emulator.replay import Driver
from sidecar_emulator.scenario import load_scenario
from tests.conftest import MIB, ROOT, maxq
from tests.harness import FakeEngine, eventually, gen, lane, write_gpu_file

# -- acceptance: calibrated on the unperturbed engine, the engine perturbed afterwards -----------------


def test_the_monitor_reports_within_one_request_and_its_margin_stops_the_crash() -> None:
    """The outage burst on the old-gather lane: `sidecar_emulator/policies/maxq-qwen3next-old.yaml` was calibrated on
    the unperturbed `maxq-old` profile; here every transient and the batch join are 1.2x larger."""
    sc = load_scenario(ROOT / "scenarios" / "maxq-outage-burst.yaml")
    profile = perturbed(get_profile(sc.profile), scale=1.2)

    def run(raise_margin: bool) -> Driver:
        d = Driver(sc, profile, maxq().with_section("monitor", raise_margin=raise_margin), sc.seed)
        d.run()
        return d

    blind = run(False)
    assert blind.crashes, "the perturbed lane must crash without the automatic margin (else no test)"
    first = blind.admission.watch.last  # type: ignore[union-attr]
    assert first is not None and first.at < blind.crashes[0]["t"]  # counted before the crash, too

    d = run(True)
    w = d.admission.watch  # type: ignore[union-attr]
    assert w.underestimates >= 1 and w.margin_finding is not None
    f = w.margin_finding
    # Within one request: the finding names the first request admitted, while it still runs.
    (rid,) = f.request_ids
    first_admitted = min(
        (a for a in d.attempts.values() if a.admitted_at is not None), key=lambda a: a.admitted_at or 0
    )
    assert rid == first_admitted.rid and f.at <= d.records[rid].end  # type: ignore[operator]
    # The policy's calibrated ratio (1.0) makes each reading count against the cost terms times what
    # was seen so far: the findings climb to what the lane allocates, x1.2 its cost terms.
    assert f.covered is not None and 1.15 < f.covered * f.ratio <= 1.2 and f.margin_after > 1.2
    assert not d.crashes
    summary = d.summary()
    assert summary["monitor"]["monitor"]["margin"]["effective"] == pytest.approx(f.margin_after, abs=1e-4)
    assert summary["ledger_at_end"] == 0 and summary["completed"] > 0


def test_the_unperturbed_lane_has_no_findings() -> None:
    sc = load_scenario(ROOT / "scenarios" / "maxq-outage-burst.yaml")
    d = Driver(sc, get_profile(sc.profile), maxq(), sc.seed)
    d.run()
    assert d.admission is not None and d.admission.watch.underestimates == 0
    assert not d.crashes


# -- the live sidecar ------------------------------------------------------------------------------


class RestartingEngine(FakeEngine):
    """A fake engine whose /metrics can fail, as while its process restarts."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "http" and scope["path"] == "/metrics" and self.down:
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b"restarting"})
            return
        await super().__call__(scope, receive, send)


def _metric(text: str, name: str) -> float | None:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "sglang_sidecar_" + name:
                return s.value
    return None


async def test_state_and_metrics_show_the_idle_figure_and_the_monitor_live(tmp_path: Path) -> None:
    engine = RestartingEngine()
    engine.gate_headers.clear()  # a long prefill: the request stays in the ledger
    overrides = dict(
        vram__headroom="idle_budget",
        vram__idle_free_bytes="auto",
        cost__activation_bytes_per_chunk_token="1MiB",
        cost__margin=1.1,
    )
    async with (
        lane(tmp_path, engine, free_mib=4096, **overrides) as (url, app, gpu_file),
        httpx.AsyncClient(timeout=10) as client,
    ):

        async def state() -> dict:  # type: ignore[type-arg]
            return (await client.get(url.admin + "/admission/state")).json()

        await eventually(lambda: app.admission.watch.idle is not None)
        s = await state()
        assert s["idle_free"]["measured_bytes"] == 4096 * MIB and s["idle_free"]["measured_at"].endswith("Z")
        assert (
            s["idle_free"]["headroom_in_force"] == "idle_budget"
            and s["idle_free"]["in_force_bytes"] == 4096 * MIB
        )
        text = (await client.get(url.admin + "/metrics")).text
        assert _metric(text, "idle_free_bytes") == 4096 * MIB
        assert _metric(text, "projection_underestimates_total") == 0
        assert _metric(text, "cost_margin") == 1.1 and _metric(text, "policy_cost_margin") == 1.1

        # A 1000-token prefill is projected at 1,100 MiB; the GPU shows 1,400 MiB taken.
        pending = asyncio.ensure_future(client.post(url + "/generate", json=gen(tokens=1000, rid="slow-1")))
        await eventually(lambda: app.admission.ledger.totals.requests == 1)
        write_gpu_file(gpu_file, 4096 * MIB - 1400 * MIB)
        await eventually(lambda: app.admission.watch.underestimates == 1)
        s = await state()
        m = s["monitor"]
        assert m["last"]["request_ids"] == ["slow-1"] and m["last"]["at"].endswith("Z")
        assert m["margin"]["effective"] == pytest.approx(1.1 * 1400 / 1100 * 1.05, abs=1e-3)
        assert m["margin"]["raised"] and m["margin"]["since"].endswith("Z")
        text = (await client.get(url.admin + "/metrics")).text
        assert _metric(text, "projection_underestimates_total") == 1
        assert _metric(text, "projection_underestimate_worst_ratio") == pytest.approx(1400 / 1100, abs=1e-3)
        explained = (await client.post(url.admin + "/admission/explain", json={"prompt_tokens": 1000})).json()
        assert explained["margin"] == pytest.approx(m["margin"]["effective"], abs=1e-3)
        engine.gate_headers.set()
        engine.release.set()
        assert (await pending).status_code == 200

        # The engine restarts (failed scrapes, then answers again): idle free is measured anew.
        engine.down = True
        await eventually(lambda: app.admission.snapshot.engine_health.consecutive_failures > 0)
        write_gpu_file(gpu_file, 5000 * MIB)
        engine.down = False
        await eventually(lambda: app.admission.watch.engine_restarts == 1)
        await eventually(lambda: app.admission.rules.vram.idle_free_bytes == 5000 * MIB)
        s = await state()
        assert s["idle_free"]["engine_restarts"] == 1 and not s["idle_free"]["after_traffic"]


def test_check_policy_and_a_shipped_policy_with_auto(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from sidecar.cli import main

    text = (ROOT / "sidecar_emulator" / "policies" / "maxq-qwen3next-old.yaml").read_text()
    path = tmp_path / "auto.yaml"
    path.write_text(text.replace("idle_free_bytes: 1372MiB", "idle_free_bytes: auto"))
    assert main(["check-policy", str(path)]) == 0
    out = capsys.readouterr().out
    assert "idle free memory: auto: measured by the sidecar" in out
    assert "nvml_free until idle free memory is measured, then idle_budget" in out
    # Tolerance 0 (the shipped policy, margin 1.0): every overrun past min_bytes is counted, nothing
    # finer to ask for: no note.
    said = (
        "monitor: under-predictions (over the cost terms x1 by more than 1 MiB: "
        "cost.calibrated_ratio, not the margin) are counted and logged, and raise cost.margin (1) to "
        "what they showed x1.05 (at least + 0.1)"
    )
    assert said in out and "note:" not in out
    # Without a calibrated ratio a reading is compared with the projection, margin included.
    path.write_text(text.replace("calibrated_ratio: 1.0", ""))
    assert main(["check-policy", str(path)]) == 0
    assert "(over the projection by more than 1 MiB)" in capsys.readouterr().out
    # A tolerance coarser than the margin's slack over the ratio is noted: 1.1 % against 2 %.
    coarse = text.replace("tolerance: 0\n", "tolerance: 0.02\n").replace("margin: 1.0\n", "margin: 1.011\n")
    path.write_text(coarse)
    assert main(["check-policy", str(path)]) == 0
    out = capsys.readouterr().out
    assert "by more than 2.0% and 1 MiB" in out
    assert "note: the margin leaves 1.1% of a peak, not more than that tolerance" in out
    path.write_text(text.replace("idle_free_bytes: 1372MiB", "idle_free_bytes: automatic"))
    assert main(["check-policy", str(path)]) != 0
    err = capsys.readouterr()
    assert "vram.idle_free_bytes" in err.out + err.err and "or auto" in err.out + err.err
