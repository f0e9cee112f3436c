"""The admission benchmark's robustness block: engine changes the policy was not told about.

Each row runs the shipped lane policies (``policies/``: what an operator deploys, not the scenarios'
emulator-exact ones in ``sidecar_emulator/policies/``) on an emulated engine that differs from the one
the policy describes, and the oracle (a copy of the true engine decides each admission) on the same
engine, over the same seeds:

* within the policy's stated safety: every allocation rounded up to 2 MiB blocks (PyTorch's caching
  allocator), transients x1.03 and x1.05 from the start, x1.05 from a moment on;
* beyond it: transients x1.10 and x1.25 from a moment on (``admission.LATE_S``);
* a planned restart onto a new build whose transients are x1.10;
* lanes and workloads of their own (the engine unperturbed): ``n`` = 4 parallel samples on the Mamba
  lane, a two-GPU lane with unequal neighbours, a dense 70B FP8 lane with a ~33K-token pool under the
  generic policy, and calibrate-then-serve on a lane that allocates 700 MiB per prefill step more.

Acceptance (issue 29): 0 crashes within the safety; beyond it at most one crash per run (none after
the first), none after a restart with a new build; every row >= 90 % of the oracle's goodput; rounding
or x1.03 cost <= 5 % against the unperturbed engine. Run by ``bench/admission.py`` (``make
bench-admission``) after its study; alone: ``python bench/robustness.py --seeds 3``.
"""

from __future__ import annotations

import argparse
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import admission as A

SCENARIOS = ["maxq-outage-burst", "agents-with-subagents", "band-below-limit"]
# (label, perturbation, class, scenarios): "base" the unperturbed engine, "within" the policy's stated
# safety, "beyond" more than it, "upgrade" a restart onto a new build, "lane" a workload or lane shape
# of its own (unperturbed engine). Scenarios None: ``SCENARIOS`` (or ``--scenarios``).
ROWS: list[tuple[str, str, str, tuple[str, ...] | None]] = [
    ("unperturbed", "none", "base", None),
    ("allocations rounded to 2 MiB", "round2m", "within", None),
    ("transients x1.03", "sys1.03", "within", None),
    ("transients x1.05", "sys1.05", "within", None),
    ("transients x1.05 from a moment on", "late1.05", "within", None),
    ("transients x1.10 from a moment on", "late1.10", "beyond", None),
    ("transients x1.25 from a moment on", "late1.25", "beyond", None),
    ("restart onto a build x1.10", "upgrade1.10", "upgrade", None),
    ("n = 4 parallel samples (Mamba lane)", "none", "lane", ("samples-n4",)),
    ("two-GPU lane, unequal neighbours", "none", "lane", ("tp2-unequal",)),
    ("dense 70B FP8 lane, ~33K-token pool (h200-generic policy)", "none", "lane", ("dense-small-pool",)),
    ("calibrate, then serve: 700 MiB fixed per step", "none", "lane", (A.CALIBRATED,)),
]
NOT_YET: list[str] = []


def _rows(only: list[str] | None) -> list[tuple[str, str, str, tuple[str, ...] | None]]:
    """The rows whose perturbation is in ``only`` (``--rows``), every row when None."""
    return [r for r in ROWS if only is None or r[1] in only]


def _scenarios(row: tuple[str, str, str, tuple[str, ...] | None], default: list[str]) -> list[str]:
    return list(row[3]) if row[3] is not None else default


def tasks(scenarios: list[str], seeds: int, rows: list[str] | None = None) -> list[A.Task]:
    out: dict[A.Task, None] = {}
    for row in _rows(rows):
        for sc in _scenarios(row, scenarios):
            for i in range(seeds):
                out[A.Task(sc, i, "default", row[1], "sidecar", lane_policy=True)] = None
                out[A.Task(sc, i, "default", row[1], "oracle")] = None
                # the unperturbed reference
                out[A.Task(sc, i, "default", "none", "sidecar", lane_policy=True)] = None
    return list(out)


def _goodput(r: dict[str, Any], span: float) -> float:
    return r["served_tokens"] / (span or 1.0)


def summarise(rows: list[dict[str, Any]], only: list[str] | None = None) -> list[dict[str, Any]]:
    """One line per robustness row: crashes, the worst run against the oracle and against the
    unperturbed engine (same scenario and seed; the longer of the two spans, as in the study)."""
    by = {(r["scenario"], r["seed"], r["perturbation"], r["gate"]): r for r in rows}
    default = [sc for sc in dict.fromkeys(r["scenario"] for r in rows) if not _special(sc)]
    bound = zero_crash_bound(rows)
    out = []
    for row in _rows(only):
        label, pert, klass, _ = row
        names = _scenarios(row, default)
        runs = [
            r for r in rows if r["perturbation"] == pert and r["gate"] == "sidecar" and r["scenario"] in names
        ]
        vs_oracle, vs_base, crashes, late = [], [], [], 0
        per: dict[str, float] = {}
        for r in runs:
            o = by[(r["scenario"], r["seed"], pert, "oracle")]
            base = by[(r["scenario"], r["seed"], "none", "sidecar")]
            span = max(r["span_s"], o["span_s"])
            vs_oracle.append(_goodput(r, span) / max(_goodput(o, span), 1e-9))
            per[r["scenario"]] = min(per.get(r["scenario"], math.inf), vs_oracle[-1])
            bspan = max(r["span_s"], base["span_s"])
            vs_base.append(_goodput(r, bspan) / max(_goodput(base, bspan), 1e-9))
            crashes.append(r["crashes"])
            late += sum(1 for t in r.get("crash_times", []) if t >= A.LATE_S)
        out.append(
            {
                "row": label,
                "perturbation": pert,
                "class": klass,
                "runs": len(runs),
                "crashes": sum(crashes),
                "max_crashes_per_run": max(crashes, default=0),
                "crashes_after_restart": late if klass == "upgrade" else None,
                "worst_vs_oracle": min(vs_oracle, default=0.0),
                "worst_vs_unperturbed": min(vs_base, default=0.0),
                # The worst run of each scenario against the oracle (which scenario a row's worst is).
                "worst_vs_oracle_by_scenario": per,
                "zero_crash_bound": {sc: v for sc, v in bound.items() if sc in per},
            }
        )
    return out


def zero_crash_bound(rows: list[dict[str, Any]]) -> dict[str, float]:
    """For each scenario inside the stated safety (``INSIDE_SAFETY``), the most of the unperturbed
    oracle that any gate keeping the x1.05 rows' zero-crash lines can serve, at worst over the seeds:
    the oracle's served tokens at x1.05 over its unperturbed ones (evidence RA6). Until a change shows
    in a reading, a gate sees the same lane in both rows, and a caching allocator can hide a x1.05 change
    until the prompt that crashes (RE1, RA4): what such a gate serves unperturbed, it would also admit
    after the change, so it must refuse whatever the x1.05 engine cannot hold."""
    by = {(r["scenario"], r["seed"], r["perturbation"]): r for r in rows if r["gate"] == "oracle"}
    out: dict[str, float] = {}
    for (sc, seed, pert), r in by.items():
        base = by.get((sc, seed, "none"))
        if sc in INSIDE_SAFETY and pert == "sys1.05" and base is not None and base["served_tokens"]:
            out[sc] = min(out.get(sc, math.inf), r["served_tokens"] / base["served_tokens"])
    return out


def _special(name: str) -> bool:
    return any(row[3] is not None and name in row[3] for row in ROWS)


def acceptance(summary: list[dict[str, Any]]) -> list[tuple[bool, str]]:
    lines = []
    for s in summary:
        name = s["row"]
        if s["class"] in ("within", "lane"):
            lines.append((s["crashes"] == 0, f"{name}: 0 crashes within the stated safety ({s['crashes']})"))
        if s["class"] == "beyond":
            ok = s["max_crashes_per_run"] <= 1
            lines.append((ok, f"{name}: at most one crash per run ({s['max_crashes_per_run']})"))
        if s["class"] == "upgrade":
            ok = s["crashes_after_restart"] == 0
            lines.append((ok, f"{name}: no crash after the restart ({s['crashes_after_restart']})"))
        lines.append((s["worst_vs_oracle"] >= 0.90, _oracle_line(name, s)))
        if s["class"] == "within" and s["perturbation"] != "none":
            # The issue asks this of rounding and x1.03; every change within the stated safety is held
            # to it (a x1.05 draw under a 1.05 margin must not cost what the unperturbed engine serves).
            cost = 1.0 - s["worst_vs_unperturbed"]
            lines.append((cost <= 0.05, f"{name}: costs <= 5 % against the unperturbed engine ({cost:.1%})"))
    return lines


# A scenario whose prompts sit inside the lane policy's stated safety by construction: the band's
# cold prompts at 90-99.5 % of the lane's true single-request limit, where a 16 MiB reserve and a 1.05
# margin put the unfit line at 92.1 % (evidence RA2). Its oracle line is judged like every other, and
# the line says which part of the worst it is, so that a reader sees what the rest of the row reaches.
INSIDE_SAFETY = {"band-below-limit": "RA2"}


def _oracle_line(name: str, s: dict[str, Any]) -> str:
    line = f"{name}: >= 90 % of the oracle (worst {s['worst_vs_oracle']:.1%}"
    per = s.get("worst_vs_oracle_by_scenario") or {}
    inside = {sc: v for sc, v in per.items() if sc in INSIDE_SAFETY}
    rest = [v for sc, v in per.items() if sc not in INSIDE_SAFETY]
    if inside and min(inside.values()) < 0.90:
        bound = s.get("zero_crash_bound") or {}
        why = ", ".join(
            f"{sc} {v:.0%}, inside the stated safety: {INSIDE_SAFETY[sc]}"
            + (
                f"; a gate that keeps the x1.05 rows' zero crashes serves at most {bound[sc]:.0%} of it: RA6"
                if sc in bound
                else ""
            )
            for sc, v in inside.items()
        )
        line += f"; {why}; the other scenarios' worst {min(rest, default=math.nan):.1%}"
    return line + ")"


def format_block(summary: list[dict[str, Any]], lines: list[tuple[bool, str]]) -> str:
    head = (
        "| row | class | runs | crashes | max/run | after restart | worst vs oracle | worst vs unperturbed "
        "| worst vs oracle by scenario |"
    )
    out = ["## Robustness block (shipped lane policies; engine changes they were not told about)", "", head]
    out.append("|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        after = "" if s["crashes_after_restart"] is None else str(s["crashes_after_restart"])
        by = s.get("worst_vs_oracle_by_scenario") or {}
        scen = ", ".join(f"{n} {v:.0%}" for n, v in by.items()) if len(by) > 1 else ""
        out.append(
            f"| {s['row']} | {s['class']} | {s['runs']} | {s['crashes']} | {s['max_crashes_per_run']} | "
            f"{after} | {s['worst_vs_oracle']:.1%} | {s['worst_vs_unperturbed']:.1%} | {scen} |"
        )
    out += ["", "Acceptance:"]
    out += [f"  {'PASS' if ok else 'FAIL'}  {text}" for ok, text in lines]
    if NOT_YET:
        out += ["", "Not in the block yet:"] + [f"  - {n}" for n in NOT_YET]
    return "\n".join(out)


def run(
    scenarios: list[str], seeds: int, jobs: int, rows_only: list[str] | None = None
) -> tuple[str, bool, list[dict[str, Any]]]:
    """The block's table, whether every acceptance line holds, and its rows (``rows_only``: the
    perturbations to run, every row when None)."""
    todo = tasks(scenarios, seeds, rows_only)
    if jobs > 1:
        with ProcessPoolExecutor(jobs, initializer=A._quiet) as pool:
            rows = A.run_all(todo, pool, "robustness")
    else:
        rows = A.run_all(todo, None, "robustness")
    summary = summarise(rows, rows_only)
    lines = acceptance(summary)
    return format_block(summary, lines), all(ok for ok, _ in lines), rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--scenarios", nargs="*", default=SCENARIOS)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--rows", nargs="*", default=None, help="only these perturbations (e.g. upgrade1.10); default: all"
    )
    args = ap.parse_args(argv)
    A._quiet()
    text, ok, _ = run(args.scenarios, args.seeds, args.jobs, args.rows)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
