"""replay --plot: a picture a postmortem can use, and a clear error where it cannot be written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sidecar.policy.schema import load_policy_file
from sidecar_emulator.plot import build_figure
from sidecar_emulator.profiles import get_profile
from sidecar_emulator.replay import run_replay
from sidecar_emulator.scenario import load_scenario
from tests.conftest import ROOT
from tests.test_cli import run

SCENARIOS = ROOT / "scenarios"


def replay_both(name: str) -> tuple[dict[str, dict[str, Any]], Any]:
    path = SCENARIOS / f"{name}.yaml"
    scenario = load_scenario(path)
    policy = load_policy_file(scenario.policy_path(path.parent))
    profile = get_profile(scenario.profile)
    results = {
        label: run_replay(scenario, gate=gate, policy=policy, profile=profile, seed=scenario.seed)
        for label, gate in (("ungated", False), (f"gated ({policy.policy.name})", True))
    }
    return results, policy.policy


@pytest.fixture(scope="module")
def neighbour() -> tuple[dict[str, dict[str, Any]], Any, Any]:
    results, policy = replay_both("noisy-neighbour")
    return results, policy, build_figure(results, "noisy-neighbour", policy)


def labels(ax: Any) -> set[str]:
    return {line.get_label() for line in ax.get_lines()}


def test_gated_and_ungated_share_the_time_axis_and_every_rows_scale(neighbour) -> None:  # type: ignore[no-untyped-def]
    _, _, fig = neighbour
    grid = [ax for ax in fig.axes if ax.get_visible()]
    rows = [grid[i : i + 2] for i in range(0, 6, 2)]
    for left, right in rows:
        assert left.get_ylim() == right.get_ylim()
        assert left.get_xlim() == right.get_xlim()


def test_the_tail_is_trimmed_and_no_empty_decision_panel(neighbour) -> None:  # type: ignore[no-untyped-def]
    results, _, fig = neighbour
    last_sample = max(r["series"]["t"][-1] for r in results.values())
    assert fig.axes[0].get_xlim()[1] < last_sample
    hidden = [ax for ax in fig.axes if not ax.get_visible()]
    assert len(hidden) == 1  # the ungated run's decision slot: it decided nothing
    assert not any("no decisions" in t.get_text() for ax in fig.axes for t in ax.texts)


def test_policy_limits_neighbour_memory_and_integer_counts_are_drawn(neighbour) -> None:  # type: ignore[no-untyped-def]
    _, _, fig = neighbour
    memory, usage, queues = fig.axes[1], fig.axes[3], fig.axes[5]  # the gated column
    # The reserve's figure is the policy's (calibrated); the label names it.
    assert any(label.startswith("reserve (") and "MiB)" in label for label in labels(memory))
    assert "other processes on the card" in labels(memory)
    assert "other processes on the card" in labels(fig.axes[0])
    assert {"kv.max_usage 0.95", "mamba.max_usage 0.9"} <= labels(usage)
    assert "engine_queue.max_requests 2" in labels(queues)
    ticks = queues.yaxis.get_major_locator()()
    assert all(float(t).is_integer() for t in ticks)


def test_the_crash_is_annotated_in_full(neighbour) -> None:  # type: ignore[no-untyped-def]
    results, _, fig = neighbour
    [crash] = results["ungated"]["crashes"]
    [note] = [t.get_text() for t in fig.axes[0].texts]
    flat = " ".join(note.split())
    assert crash["reason"].split(". ")[0] in flat and "MiB free" in flat and "requests failed" in flat


@pytest.mark.parametrize(
    ("out", "says"),
    [
        ("no-such-dir/night.png", "directory"),
        ("night.txt", "must end in .png, .svg or .pdf"),
        (".", "is a directory"),
    ],
)
def test_a_bad_plot_path_is_a_clear_error_before_the_run(tmp_path: Path, out: str, says: str) -> None:
    target = tmp_path / out if out != "." else tmp_path
    r = run("replay", str(SCENARIOS / "paired-250k-cold.yaml"), "--plot", str(target))
    assert r.returncode == 2
    assert says in r.stderr and "Traceback" not in r.stderr
    assert "replay paired" not in r.stdout  # refused before an hour of replay, not after


def texts(fig: Any) -> list[Any]:
    """Every piece of text the PNG shows (tick labels need a draw to exist)."""
    from matplotlib.text import Text

    fig.canvas.draw()
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def test_every_label_is_readable_at_10_pt(neighbour) -> None:  # type: ignore[no-untyped-def]
    _, _, fig = neighbour
    small = {(t.get_text()[:40], t.get_fontsize()) for t in texts(fig) if t.get_fontsize() < 10}
    assert not small


def test_the_headroom_is_stacked_from_its_parts_and_the_reserve_is_pointed_at(neighbour) -> None:  # type: ignore[no-untyped-def]
    results, policy, fig = neighbour
    memory = fig.axes[1]
    stacked = [c.get_label() for c in memory.collections if not c.get_label().startswith("_")]
    assert stacked[:2] == [
        f"reserve ({policy.vram.reserve_bytes >> 20} MiB, never handed out)",
        "ledger: projected transients",
    ]
    assert stacked[-1].startswith("gate headroom")
    # The neighbour's growth is a part of its own: it is what the budget lost.
    assert any(label.startswith("other processes' growth") for label in stacked)
    # The stack's top is the policy's idle budget wherever the gate had a reading.
    [budget] = [ln for ln in memory.get_lines() if ln.get_label() == "idle budget in force"]
    known = [h is not None for h in results[f"gated ({policy.name})"]["series"]["headroom_bytes"]]
    tops = {round(y * (1 << 30)) >> 20 for y, k in zip(budget.get_ydata(), known, strict=True) if k}
    assert tops == {policy.vram.idle_free_bytes >> 20}
    notes = " ".join(t.get_text() for t in memory.texts)
    assert (
        f"reserve {policy.vram.reserve_bytes >> 20} MiB" in notes
    )  # pointed at: a few MiB vanish at GiB scale
    assert "GPU free sits near 0" in notes and "caching allocator" in notes and "idle_budget" in notes


def test_a_decision_log_is_plotted_on_its_own_wall_clock(tmp_path: Path) -> None:
    """Replaying a real decision log, the time axis reads UTC clock times of the log, not virtual seconds."""
    import json

    from sidecar_emulator.scenario import load_trace

    start = 1764607200.0  # 2025-12-01 16:40:00 UTC
    log = tmp_path / "decisions.jsonl"
    lines = [
        {
            "ts": start + 20 * i,
            "event": "decision",
            "request_id": f"r{i}",
            "prompt_tokens": 60_000 + 10_000 * i,
        }
        for i in range(6)
    ]
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    policy = load_policy_file(ROOT / "policies/maxq-qwen3next-bounded.yaml")
    scenario = load_trace(log, profile="maxq-bounded", policy="policies/maxq-qwen3next-bounded.yaml")
    assert scenario.start_unix == start
    results = {
        "gated": run_replay(scenario, gate=True, policy=policy, profile=get_profile("maxq-bounded"), seed=0)
    }
    fig = build_figure(results, "night", policy.policy, start_unix=scenario.start_unix)
    texts(fig)
    bottom = [ax for ax in fig.axes if ax.get_visible()][-1]
    assert "UTC" in bottom.get_xlabel() and "2025-12-01" in bottom.get_xlabel()
    ticks = [t.get_text() for t in bottom.get_xticklabels() if t.get_text()]
    assert ticks and all(t.startswith("16:") and t.count(":") == 2 for t in ticks), ticks
    assert "16:40:00" in fig.get_suptitle() and "2025-12-01" in fig.get_suptitle()
    # A request log (relative t) has no clock to show.
    rel = tmp_path / "requests.jsonl"
    rel.write_text(json.dumps({"t": 0, "prompt_tokens": 1000}) + "\n")
    assert load_trace(rel, profile="maxq-bounded", policy="x").start_unix is None
