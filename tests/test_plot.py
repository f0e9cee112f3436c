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
