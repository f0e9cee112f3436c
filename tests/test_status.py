"""The live view for on-call: ``sglang-sidecar status`` and ``GET /admission/status`` during the outage.

The acceptance run is ``make demo``'s gated phase (the emulator, the real sidecar on both ports, the
scenario's clients): once the burst is held, the CLI (a real process) and the page in a real headless
Chromium (Debian's package, ``scripts/tools.sh``) must both show the hold queue built up and the
reason it waits for. ``SIDECAR_UPDATE_SCREENSHOT=1`` keeps the browser's screenshot as docs/status.png.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import yaml

from sidecar.ops import status
from sidecar.policy.schema import load_policy_file
from sidecar_emulator.demo import DEFAULT_SCENARIO, run_phase, scale_policy
from sidecar_emulator.scenario import load_scenario
from tests.browser import Browser
from tests.conftest import ROOT
from tests.harness import FakeEngine, eventually, gen, lane

# Slower than the demo's 25x: the hold build-up lasts ~65 engine seconds, here ~6.5 s of wall time.
SPEED = 10.0
HELD_AT_LEAST = 3


def views_of(out: str) -> list[str]:
    """The views a ``status --watch`` printed (each ends with its URL and time)."""
    return [v for v in out.split("\n(http") if "Hold queue" in v] or [""]


def held_in(view: str) -> int:
    m = re.search(r"held\s+(\d+) of \d+", view)
    return int(m.group(1)) if m else -1


async def test_status_and_the_page_show_the_outage_holds_building_up(tmp_path: Path) -> None:
    scenario = load_scenario(DEFAULT_SCENARIO)
    policy = scale_policy(load_policy_file(scenario.policy_path(DEFAULT_SCENARIO.parent)), SPEED)
    seen: dict[str, Any] = {}

    async def watch(admin: str) -> None:
        # Both look from the start (a process and a browser start in seconds on a busy machine; the
        # build-up lasts a few): the CLI redraws every 0.3 s, the browser loads the page when it is on.
        argv = ["status", "--admin", admin, "--interval", "0.3", "--watch", "--count", "10000"]
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sidecar", *argv, stdout=asyncio.subprocess.PIPE, cwd=ROOT
        )
        lines: list[str] = []

        async def read() -> None:
            assert cli.stdout is not None
            async for line in cli.stdout:
                lines.append(line.decode())

        reader = asyncio.create_task(read())
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                # An earlier view of the page (an on-call engineer's open tab): the browser's gets rates.
                assert (await client.get(admin + "/admission/status")).status_code == 200
            async with Browser(tmp_path / "chromium") as browser, httpx.AsyncClient(timeout=5) as client:

                async def held() -> bool:
                    return (await client.get(admin + "/admission/state")).json()["queue"][
                        "held"
                    ] >= HELD_AT_LEAST

                await eventually(held, timeout=60)
                seen["dom"], seen["png"] = await browser.open(admin + "/admission/status")
            # The terminal's views of the same build-up (its first one comes after its start-up).
            await eventually(lambda: max(held_in(v) for v in views_of("".join(lines))) >= 1, timeout=60)
        finally:
            cli.terminate()
            await cli.wait()
            await reader
            seen["cli"] = "".join(lines)

    gated = await run_phase(scenario, policy, SPEED, scenario.seed, "gated", 240.0, watch=watch)
    assert gated["crashes"] == [] and gated["held_then_admitted"] > 0
    # The terminal: the policy, the queue built up, what it waits for, headroom against the largest admit.
    text = max(views_of(seen["cli"]), key=held_in)
    assert "maxq-qwen3next-old · enforce" in text, text
    assert held_in(text) >= 1, text
    assert "first in line waits for" in text and "held since start, by reason" in text, text
    assert "largest admitted projection" in text and "ALERTS that would fire" in text, text
    # The page, as a real browser rendered it: the same rows.
    dom = seen["dom"]
    assert 'id="headline"' in dom and "maxq-qwen3next-old" in dom
    # Rates against the page's previous reading, or counts since start when the browser's load came
    # first (its meta refresh may have re-read the page before the DOM was taken): admits either way.
    assert re.search(r"<td>admit</td><td>[\d.]+(/s)?</td>", dom), dom
    page_held = int(re.search(r"held (\d+)/\d+", dom).group(1))  # type: ignore[union-attr]
    assert page_held >= 1 and "Hold queue" in dom and "first in line waits for" in dom
    assert 'http-equiv="refresh"' in dom and "<script" not in dom
    shot = tmp_path / "status.png"
    shot.write_bytes(seen["png"])
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    if os.environ.get("SIDECAR_UPDATE_SCREENSHOT"):
        shutil.copy(shot, ROOT / "docs" / "status.png")
        (ROOT / "docs" / "status.txt").write_text(text.strip() + "\n")


async def test_status_rates_alerts_and_watch_against_a_lane(tmp_path: Path) -> None:
    """A lane with no room: requests are held, then time out, for as long as the CLI watches. Each of
    its --count views rates them per second by reason and names the alerts that would fire."""
    engine = FakeEngine(events=1)
    async with (
        lane(tmp_path, engine, free_mib=0, hold__max_wait_s=0.2) as (url, _app, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        argv = ["status", "--admin", url.admin, "--interval", "1", "--watch", "--count", "2"]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sidecar", *argv, stdout=asyncio.subprocess.PIPE, cwd=ROOT
        )
        reasons = set()
        sent = 0
        while proc.returncode is None:
            answers = await asyncio.gather(
                *(client.post(url + "/generate", json=gen(rid=f"s{sent + i}")) for i in range(4))
            )
            sent += 4
            reasons |= {r.headers["x-admission-reason"] for r in answers}
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 0.01)
        out, _ = await proc.communicate()
    text = out.decode()
    assert proc.returncode == 0 and reasons == {"hold_timeout"}
    views = text.split("ALERTS that would fire:")[1:]
    assert len(views) == 2, text
    for v in views:
        assert re.search(r"reject: hold_timeout\s+[1-9][\d.]*/s", v), v
        assert re.search(r"held: (vram_headroom|signals_stale)\s+[1-9][\d.]*/s", v), v
        assert "SidecarHoldTimeouts" in v and "SidecarRejectRatioHigh" in v and "SidecarGateClosed" in v, v


def test_the_alerts_the_view_evaluates_are_the_shipped_rules() -> None:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    names = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    source = Path(status.__file__).read_text()
    evaluated = set(re.findall(r'"(Sidecar[A-Za-z]+)"', source))
    assert evaluated and evaluated <= names
    # Every rule is either evaluated or named as Prometheus's own view.
    assert names - evaluated == {"SidecarDown", "SidecarNotScraped"}


def test_status_says_why_it_cannot_read_the_admin_port() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "sidecar", "status", "--admin", "http://127.0.0.1:9", "--interval", "0.1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 1 and "cannot read http://127.0.0.1:9" in r.stderr and "Traceback" not in r.stderr


async def test_measured_vs_policy_shows_what_the_state_reports_and_tolerates_absence(tmp_path: Path) -> None:
    """Every policy-vs-measured figure the state carries gets a row (a newer state's lane facts too),
    a disagreement is flagged; a state without the monitor's or guard's sections still renders."""
    async with (
        lane(tmp_path, FakeEngine(events=1)) as (url, _app, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        st = (await client.get(url.admin + "/admission/state")).json()
        metrics = status.Metrics.parse((await client.get(url.admin + "/metrics")).text)
    st["facts"] = {
        "kv_pool_tokens": {
            "policy": 100000,
            "measured": 90000,
            "in_force": 90000,
            "disagrees": True,
            "unsafe": True,
        },
        "context_len": {
            "policy": 100000,
            "measured": 100000,
            "in_force": 100000,
            "disagrees": False,
            "unsafe": False,
        },
    }
    text = status.render_text(status.view(status.Sample(1.0, st, metrics)))
    assert re.search(
        r"facts\.kv_pool_tokens\s+policy 100,000, measured 90,000, in force 90,000 · DISAGREES", text
    )
    assert re.search(r"facts\.context_len\s+policy 100,000, measured 100,000, in force 100,000\n", text)
    assert re.search(r"idle_free\s+policy unknown, measured", text)
    for key in ("monitor", "guard", "facts", "idle_free", "lane_facts"):
        st.pop(key, None)
    bare = status.render_text(status.view(status.Sample(1.0, st, metrics)))
    assert "Measured vs policy" in bare and "(none reported)" in bare
    page = status.render_html(status.view(status.Sample(1.0, st, metrics)), 2.0, "now")
    assert "<script" not in page and 'http-equiv="refresh" content="2"' in page


def test_the_lane_alerts_fire_from_the_metrics_that_feed_them() -> None:
    """The robustness alerts in the view read the same series as alerts.yml: a disagreeing fact, a
    crash since the previous reading, a build not yet confirmed; and stay quiet without them."""
    fresh = {"age_s": 0.0, "consecutive_failures": 0}
    state = {"gate_open": True, "headroom_bytes": 1, "engine": fresh, "gpu": fresh}

    def sample(at: float, text: str) -> status.Sample:
        return status.Sample(at, state, status.Metrics.parse(text))

    quiet = sample(0.0, "sglang_sidecar_engine_crashes_total 0\nsglang_sidecar_engine_build_unconfirmed 0\n")
    loud = sample(
        1.0,
        'sglang_sidecar_lane_fact_disagreement{fact="idle_free_bytes",unsafe="true"} 1\n'
        'sglang_sidecar_lane_fact_disagreement{fact="context_len",unsafe="false"} 0\n'
        "sglang_sidecar_engine_crashes_total 1\nsglang_sidecar_engine_build_unconfirmed 1\n",
    )
    lane = {
        "SidecarPolicyDisagreesWithLane",
        "SidecarEngineCrashedUnderLoad",
        "SidecarEngineBuildUnconfirmed",
    }
    assert {a for a, _ in status.alerts_firing(quiet, None)} & lane == set()
    fired = dict(status.alerts_firing(loud, quiet))
    assert lane <= set(fired)
    assert fired["SidecarPolicyDisagreesWithLane"].startswith("idle_free_bytes:")
    assert "1 engine crash" in fired["SidecarEngineCrashedUnderLoad"]
