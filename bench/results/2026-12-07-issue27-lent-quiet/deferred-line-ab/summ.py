"""One line per overhead.py JSON: the sidecar's gated and pass-through CPU, the gate work, SSE per event."""

import json
import sys


def us(row: dict) -> float:
    return 1e3 * row["cpu_s_per_1000_requests"]


for f in sys.argv[1:]:
    with open(f) as fh:
        rows = {(x["path"], x["kind"]): x for x in json.load(fh)["rows"]}
    g, p = rows[("sidecar", "small")], rows[("sidecar", "small-passthrough")]
    s = rows[("sidecar", "sse")]
    each = [round(1e3 * v) for v in g["cpu_s_per_1000_requests_rounds"]]
    name = f.rsplit("/", 1)[-1]
    print(
        f"{name:28} gated {us(g):6.1f} {each} pass {us(p):6.1f} gate work {us(g) - us(p):5.1f} "
        f"sse/ev {1e3 * s['cpu_s_per_1000_events']:.2f}"
    )
