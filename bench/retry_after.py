"""Does Retry-After mean something? Replays every scenario and, for each rejection that advertised a
Retry-After, asks the gate at that instant whether a retry would have been let in (admitted, or
queued instead of rejected) or admitted at once.

The shipped policies reject almost nothing transient (they hold), so each scenario also runs with the
hold queue's bounds tightened (``max_held``/``max_wait_s`` below): that is where Retry-After matters.
Virtual time, seconds in all. Prints a Markdown table and writes it to bench/results/:

    .venv/bin/python bench/retry_after.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sidecar.policy.schema import load_policy_file  # noqa: E402
from sidecar_emulator.profiles import get_profile  # noqa: E402
from sidecar_emulator.replay import run_replay  # noqa: E402
from sidecar_emulator.scenario import load_scenario  # noqa: E402

VARIANTS = [
    ("shipped", None),
    ("max_held 4, max_wait 120 s", (4, 120)),
    ("max_held 2, max_wait 60 s", (2, 60)),
]


def pct(k: int, n: int) -> str:
    return "-" if not n else f"{k}/{n} ({100 * k / n:.0f} %)"


def main() -> int:
    rows = [
        "| scenario | hold bounds | rejected with Retry-After | retry let in | admitted at once | crashes |",
        "|---|---|---:|---:|---:|---:|",
    ]
    total = [0, 0, 0]
    for path in sorted((ROOT / "scenarios").glob("*.yaml")):
        sc = load_scenario(path)
        base = load_policy_file(sc.policy_path(path.parent))
        for label, bounds in VARIANTS:
            policy = (
                base
                if bounds is None
                else base.with_section("hold", max_held=bounds[0], max_wait_s=bounds[1])
            )
            r = run_replay(sc, gate=True, policy=policy, profile=get_profile(sc.profile), seed=sc.seed)
            n, let_in, now = r["retry_after_advertised"], r["retry_after_let_in"], r["retry_after_admitted"]
            total = [total[0] + n, total[1] + let_in, total[2] + now]
            rows.append(
                f"| {sc.name} | {label} | {n} | {pct(let_in, n)} | {pct(now, n)} | {len(r['crashes'])} |"
            )
    rows.append(f"| **all** | | {total[0]} | {pct(total[1], total[0])} | {pct(total[2], total[0])} | |")
    text = "\n".join(rows)
    print(text)
    out = ROOT / "bench" / "results" / "retry-after.md"
    out.write_text(
        "# Retry-After in replay\n\n`.venv/bin/python bench/retry_after.py` (virtual time, each scenario's "
        'seed). "Let in": a retry at the advertised time would have been admitted or queued; "admitted '
        'at once": admitted with nobody held ahead.\n\n' + text + "\n"
    )
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
