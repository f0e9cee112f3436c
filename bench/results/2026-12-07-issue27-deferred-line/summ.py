"""The saturation rows of overhead.py's JSON files side by side (µs CPU per request; spread over rounds)."""

import json
import sys
from pathlib import Path

PATHS = ("nginx", "floor-uvicorn", "floor", "sidecar")
KINDS = ("small", "small-passthrough")
print(
    "| run | host speed spread | " + " | ".join(f"{p} {k}" for k in KINDS for p in PATHS) + " | gate work |"
)
print("|---|---:|" + "---:|" * (len(PATHS) * len(KINDS) + 1))
for f in sys.argv[1:]:
    doc = json.loads(Path(f).read_text())
    rows = {(r["path"], r["kind"]): r for r in doc["rows"] if r["load"] == "saturation"}
    cells = []
    for k in KINDS:
        for p in PATHS:
            r = rows.get((p, k))
            cells.append(
                "-" if r is None else f"{1000 * r['cpu_s_per_1000_requests']:.0f} ({r['cpu_spread']:.2f})"
            )
    g, s = rows[("sidecar", "small")], rows[("sidecar", "small-passthrough")]
    work = 1000 * (g["cpu_s_per_1000_requests"] - s["cpu_s_per_1000_requests"])
    sp = doc.get("host_speed", {}).get("spread")
    print(
        f"| {f.split('/')[-2]} | {'-' if sp is None else f'{sp:.2f}x'} | "
        + " | ".join(cells)
        + f" | {work:.1f} |"
    )
