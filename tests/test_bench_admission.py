"""bench/admission.py: a tiny configuration end to end (rows, schema, the oracle bounds the others)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.conftest import ROOT

ROW_FIELDS = {
    "scenario",
    "gate",
    "setting",
    "lag",
    "perturbation",
    "seed",
    "crashes",
    "downtime_s",
    "completed",
    "goodput_tokens_per_s",
    "goodput_vs_oracle",
    "ttft_p99_s",
    "rejected",
    "rejected_by_reason",
    "held_by_reason",
}
GATES = {
    "none",
    "static-cap",
    "token-budget",
    "max-length",
    "gie-saturation",
    "smg-overload",
    "sidecar",
    "oracle",
}


def _bench() -> ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_admission", ROOT / "bench" / "admission.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_admission"] = bench  # a pool's workers pickle run_task by this name
    spec.loader.exec_module(bench)
    return bench


def test_a_tiny_run_writes_rows_of_every_gate_and_the_oracle_bounds_them(tmp_path: Path) -> None:
    out, png = tmp_path / "a.json", tmp_path / "a.png"  # the plot goes beside the rows by default
    r = subprocess.run(
        [
            sys.executable,
            "bench/admission.py",
            "--quick",
            "--scenarios",
            "maxq-outage-burst",
            "--settings",
            "default/none",
            "laggy/none",
            "--jobs",
            "1",
            "--json",
            str(out),
            "--no-robustness",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Emulator fidelity" in r.stdout and "Acceptance" in r.stdout
    rows = json.loads(out.read_text())
    assert {row["gate"] for row in rows} == GATES
    for row in rows:
        assert set(row) >= ROW_FIELDS, ROW_FIELDS - set(row)
        assert row["lag"] in ("default", "laggy")
    oracle = {(o["seed"], o["lag"]): o for o in rows if o["gate"] == "oracle"}
    assert all(o["crashes"] == 0 for o in oracle.values())
    for row in rows:
        o = oracle[(row["seed"], row["lag"])]
        # Nothing serves more than the oracle on the same seed and setting; the engine alone crashes here.
        assert row["goodput_tokens_per_s"] <= o["goodput_tokens_per_s"] * 1.0001, row
    assert any(row["gate"] == "none" and row["crashes"] for row in rows)
    assert png.stat().st_size > 10_000


def test_rows_do_not_depend_on_the_number_of_workers() -> None:
    """Runs are pure functions of their task: one process and a pool of two give the same rows."""
    import argparse
    from concurrent.futures import ProcessPoolExecutor

    bench = _bench()
    args = argparse.Namespace(
        scenarios=["paired-250k-cold"], seeds=2, settings=["default/neighbour"], quick=True
    )

    def rows(pool: ProcessPoolExecutor | None) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "wall_s"} for r in bench.study(args, pool)]

    alone = rows(None)
    with ProcessPoolExecutor(2) as pool:
        assert rows(pool) == alone
    assert {r["gate"] for r in alone} == GATES and len({r["seed"] for r in alone}) == 2


def _cell(goodput: float, default_crashes: int, off_default_crashes: int, vs_oracle: float = 1.0) -> dict:
    robust = {"default/none": (default_crashes, vs_oracle), "default/x1.2": (off_default_crashes, 0.0)}
    return {
        "setting": "s",
        "by": {},
        "crashes": default_crashes,
        "goodput": goodput,
        "vs_oracle": vs_oracle,
        "robust": robust,
        "all_crashes": default_crashes + off_default_crashes,
    }


def test_a_baseline_is_a_rival_only_when_it_is_crash_free_on_every_setting_as_the_sidecar_must_be() -> None:
    """The acceptance compares the sidecar with "every baseline that also had zero crashes on that
    scenario": one above it that crashes off the default setting is named in a note, not a SHORT; one
    above it that never crashes is a SHORT; one below it, or crashing on the default setting, is neither."""
    bench = _bench()
    summary = {
        "sc": {
            "sidecar": _cell(100.0, 0, 0, vs_oracle=0.99),
            "oracle": _cell(101.0, 0, 0),
            "max-length": _cell(101.0, 0, 3),
            "static-cap": _cell(99.0, 0, 0),
            "none": _cell(500.0, 2, 0),
        }
    }
    lines = bench.acceptance(summary)
    assert lines[0].split() == ["sc", "meets", "the", "targets", "(99%", "of", "oracle)"]
    notes = [x for x in lines if "note:" in x]
    assert len(notes) == 1 and "crashes 3 times off it (default/x1.2)" in notes[0]
    assert "max-length: the sidecar is 0.99% below it on the default setting" in notes[0]
    assert not any("SHORT" in x for x in lines)

    summary["sc"]["token-budget"] = _cell(102.0, 0, 0)
    lines = bench.acceptance(summary)
    assert "SHORT: below zero-crash token-budget (by 1.96%)" in lines[0]
    assert "max-length" not in lines[0] and "none" not in lines[0]


def test_a_subset_of_gates_runs_those_and_the_oracle_that_bounds_them() -> None:
    """``--gates sidecar`` (more seeds for the zero-crash check) still runs the oracle: every row's
    goodput is measured over the oracle's span and against its bound."""
    import argparse

    bench = _bench()
    args = argparse.Namespace(
        scenarios=["paired-250k-cold"], seeds=1, settings=["default/none"], quick=True, gates=["sidecar"]
    )
    rows = bench.study(args, None)
    assert sorted(r["gate"] for r in rows) == ["oracle", "sidecar"]
    assert all(r["goodput_vs_oracle"] is not None for r in rows)


def test_the_zero_crash_check_runs_the_sidecar_on_further_seeds_and_only_its_crashes_count() -> None:
    """``--crash-seeds``: the sidecar alone on the seeds past the tables'; its rows are marked, kept out
    of the tables (no oracle ran on their seeds) and counted in the acceptance's crashes."""
    import argparse

    bench = _bench()
    args = argparse.Namespace(
        scenarios=["paired-250k-cold"],
        seeds=1,
        settings=["default/none"],
        quick=True,
        gates=["sidecar"],
        crash_seeds=3,
    )
    rows = bench.study(args, None)
    checks = [r for r in rows if r["crash_check"]]
    assert [r["gate"] for r in checks] == ["sidecar", "sidecar"]
    assert {r["seed"] for r in checks}.isdisjoint(r["seed"] for r in rows if not r["crash_check"])
    assert all(r["goodput_vs_oracle"] is None and not r["best"] for r in checks)
    summary = bench.summarise(rows)
    assert len(summary["paired-250k-cold"]["sidecar"]["by"]["default/none"]) == 1
    assert bench.checked_crashes(rows) == {"paired-250k-cold": {}}

    checks[1]["crashes"] = 1
    lines = bench.acceptance(summary, bench.checked_crashes(rows))
    seed = checks[1]["seed"]
    assert f"SHORT: 1 crash in the zero-crash check (default/none seed {seed})" in lines[0]
    tables = bench.format_tables(rows, [("f", "a", "b")])
    assert "The zero-crash check ran the sidecar alone on 2 more seeds" in tables
    assert bench.seed_counts(rows) == (1, 2)
    assert bench._title(rows).endswith("(1 seed(s), 1 settings; sidecar crashes over 3 seeds)")


def test_policy_set_changes_the_sidecars_policy_validated_and_names_a_wrong_field() -> None:
    """``--policy-set``: a what-if run with a field of the sidecar's policy changed, parsed and checked as
    a policy file's field is, and an error that names the field it could not set."""
    import pytest

    bench = _bench()
    shipped = bench.policy_for("band-below-limit")
    changed = bench.with_overrides(shipped, (("cost.margin", "1.05"), ("vram.reserve_bytes", "64MiB")))
    assert changed.policy.cost.margin == 1.05 and changed.policy.vram.reserve_bytes == 64 * 2**20
    assert changed.policy.monitor == shipped.policy.monitor
    assert bench.with_overrides(shipped, ()) is shipped
    for key, value, said in [
        ("cost.margn", "1", "cost.margn: no field 'margn' in cost; did you mean 'margin'?"),
        ("cots.margin", "1", "cots.margin: no policy section 'cots'"),
        ("cost.margin", "0.5", "cost.margin: must be at least 1, got 0.5"),
    ]:
        with pytest.raises(ValueError) as e:
            bench.with_overrides(shipped, ((key, value),))
        assert said in str(e.value)
    task = bench.Task("band-below-limit", 0, "default", "none", "sidecar", None, (("cost.margin", "1.1"),))
    row = bench.run_task(task)
    assert row["setting"].endswith(" cost.margin=1.1") and row["completed"] == 0 and row["crashes"] == 0


def test_the_robustness_block_runs_its_engine_changes_and_prints_its_acceptance() -> None:
    """A smoke of bench/robustness.py on one scenario, one seed and three engine changes: each is run
    for the sidecar and the oracle on the perturbed engine, and each acceptance line is printed with
    its verdict (the full block runs in `make bench-admission`)."""
    robustness = _load("robustness")
    some = {"none", "round2m", "sys1.05"}
    todo = [t for t in robustness.tasks(["agents-with-subagents"], 1) if t.perturbation in some]
    todo = [t for t in todo if t.scenario == "agents-with-subagents"]
    rows = robustness.A.run_all(todo, None, "smoke")
    assert {(r["perturbation"], r["gate"]) for r in rows} == {
        (p, g) for p in some for g in ("sidecar", "oracle")
    }
    summary = [s for s in robustness.summarise(rows) if s["runs"]]
    assert {s["perturbation"] for s in summary} == some
    lines = robustness.acceptance(summary)
    text = robustness.format_block(summary, lines)
    assert "Acceptance:" in text and all(t in text for _, t in lines)
    # Within the stated safety the shipped bounded-build policy does not crash on this scenario.
    assert all(s["crashes"] == 0 for s in summary if s["class"] == "within")


def test_the_engine_changes_are_the_engines_not_the_policys() -> None:
    """The perturbations change what the emulated engine draws, never the profile's model terms that
    a policy or calibrate would read."""
    admission = _load("robustness").A
    base = admission.profile_for("maxq-bounded")
    for name in ("round2m", "sys1.03", "late1.10", "upgrade1.10"):
        p = admission.perturbed(base, "default", name)
        assert (p.activation_bytes_per_token, p.context_bytes_per_token) == (
            base.activation_bytes_per_token,
            base.context_bytes_per_token,
        )
    assert admission.perturbed(base, "default", "round2m").allocation_round_bytes == 2 * 1024 * 1024
    assert admission.perturbed(base, "default", "late1.10").transient_scale_from_s == admission.LATE_S


def _load(name: str) -> ModuleType:
    """A bench module by its own name (bench/robustness.py imports bench/admission.py as ``admission``)."""
    import importlib

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_a_robustness_row_end_to_end_on_the_band_with_the_lane_policy() -> None:
    """The band below the lane's limit on its lane policy (``policies/``, margin 1.05, 16 MiB): a lane
    drawing x1.03 from the start is within the stated safety, so it serves what the unperturbed lane
    serves (the monitor's readings bound the draw within the margin: nothing raised); one drawing x1.10
    from a moment on is beyond it, and the prompt caught in it is aborted, not the engine."""
    bench = _bench()
    task = bench.Task("band-below-limit", 0, "default", "none", "sidecar", lane_policy=True)
    assert bench.policy_for("band-below-limit", True).policy.cost.margin == 1.05
    base = bench.run_task(task)
    within = bench.run_task(bench.Task(**{**task.__dict__, "perturbation": "sys1.03"}))
    assert base["crashes"] == within["crashes"] == 0
    assert within["served_tokens"] == base["served_tokens"] > 0
    beyond = bench.run_task(bench.Task(**{**task.__dict__, "perturbation": "late1.10"}))
    assert beyond["crashes"] == 0 and beyond["guard_aborts"] >= 1


def test_the_band_s_oracle_line_names_the_most_a_zero_crash_gate_can_serve() -> None:
    """The bound on the band inside the stated safety: the x1.05 oracle's served tokens over the
    unperturbed oracle's, the worst seed; printed on the band's oracle line, and only for scenarios
    inside the safety (another scenario's line is unchanged)."""
    robustness = _load("robustness")

    def row(sc: str, seed: int, pert: str, gate: str, tokens: int) -> dict:
        return {
            "scenario": sc,
            "seed": seed,
            "perturbation": pert,
            "gate": gate,
            "served_tokens": tokens,
            "span_s": 100.0,
            "crashes": 0,
        }

    band, other = "band-below-limit", "agents-with-subagents"
    rows = [
        row(band, 0, "none", "oracle", 1000),
        row(band, 0, "sys1.05", "oracle", 600),
        row(band, 1, "none", "oracle", 1000),
        row(band, 1, "sys1.05", "oracle", 500),
        row(other, 0, "none", "oracle", 1000),
        row(other, 0, "sys1.05", "oracle", 900),
        row(band, 0, "none", "sidecar", 120),
        row(band, 1, "none", "sidecar", 120),
        row(other, 0, "none", "sidecar", 1000),
    ]
    assert robustness.zero_crash_bound(rows) == {band: 0.5}
    (s,) = [s for s in robustness.summarise(rows, ["none"]) if s["row"] == "unperturbed"]
    assert s["zero_crash_bound"] == {band: 0.5}
    ok, line = robustness.acceptance([s])[0]
    assert not ok
    assert (
        f"{band} 12%, inside the stated safety: RA2; a gate that keeps the x1.05 rows' zero crashes serves at most 50% of it: RA6"
        in line
    )
    assert "the other scenarios' worst 100.0%" in line
