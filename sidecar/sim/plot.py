"""One picture per replay: why the gate did what it did, on one time axis.

Rows: free VRAM with the gate's headroom and the ledger's projected transients (crashes marked);
KV and Mamba usage; the engine's queue and the sidecar's held queue; each decision by reason.
matplotlib is imported here only, with the Agg backend: no display needed.
"""

from __future__ import annotations

from typing import Any

GIB = 1 << 30
REASON_ROWS = [
    "admit",
    "vram_headroom",
    "kv_pool",
    "mamba_slots",
    "engine_queue",
    "pending_prefill_tokens",
    "signals_stale",
    "engine_unavailable",
    "unfit_request",
    "queue_full",
    "hold_timeout",
    "draining",
]


def plot_replay(results: dict[str, dict[str, Any]], out: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(results.items())
    fig, axes = plt.subplots(
        4,
        len(runs),
        figsize=(7 * len(runs), 11),
        sharex="col",
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 2, 2, 2]},
    )
    for col, (label, r) in enumerate(runs):
        s = r["series"]
        t = s["t"]
        ax = axes[0][col]
        ax.set_title(
            f"{label}: {len(r['crashes'])} crash(es), {r['completed']} completed, {r['rejected']} rejected",
            fontsize=10,
        )
        ax.plot(t, [v / GIB for v in s["free_bytes"]], lw=1, color="tab:blue", label="GPU free")
        if r["gate"]:
            ax.plot(
                t,
                [None if v is None else max(v, 0) / GIB for v in s["headroom_bytes"]],
                lw=1,
                color="tab:green",
                label="gate headroom",
            )
            ax.plot(
                t,
                [v / GIB for v in s["ledger_projected_bytes"]],
                lw=1,
                color="tab:orange",
                label="ledger: projected transients",
            )
        # While the engine is down its memory is free; keep the scale of the running engine readable.
        downtime = r.get("restart_s", 0)
        up_free = [
            v
            for v, tt in zip(s["free_bytes"], t, strict=True)
            if not any(c["t"] <= tt < c["t"] + downtime for c in r["crashes"])
        ]
        top = max(up_free, default=GIB) / GIB * 1.25
        ax.set_ylim(0, top)
        for c in r["crashes"]:
            ax.axvspan(c["t"], c["t"] + downtime, color="red", alpha=0.08)
            ax.axvline(c["t"], color="red", lw=1.5)
            ax.annotate(f"crash: {c['reason'][:40]}", (c["t"], top * 0.92), color="red", fontsize=7)
        ax.set_ylabel("GiB")
        ax.legend(fontsize=7, loc="upper right")

        ax = axes[1][col]
        ax.plot(t, s["full_usage"], lw=1, label="KV (full) usage")
        if any(v is not None for v in s["mamba_usage"]):
            ax.plot(t, s["mamba_usage"], lw=1, label="Mamba usage")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("usage")
        ax.legend(fontsize=7, loc="upper right")

        ax = axes[2][col]
        ax.step(t, s["engine_queue"], where="post", lw=1, label="engine waiting queue")
        ax.step(t, s["running"], where="post", lw=1, label="engine running")
        ax.step(t, s["held"], where="post", lw=1, label="sidecar held")
        ax.set_ylabel("requests")
        ax.legend(fontsize=7, loc="upper right")

        ax = axes[3][col]
        events = r.get("decision_events", [])
        colors = {"admit": "tab:green", "hold": "tab:orange", "reject": "tab:red"}
        for action in ("admit", "hold", "reject"):
            xs = [e[0] for e in events if e[1] == action]
            ys = [REASON_ROWS.index(e[2] or "admit") for e in events if e[1] == action]
            ax.scatter(xs, ys, s=10, color=colors[action], label=action)
        ax.set_yticks(range(len(REASON_ROWS)), REASON_ROWS, fontsize=7)
        ax.set_ylim(-0.5, len(REASON_ROWS) - 0.5)
        ax.set_xlabel("virtual time (s)")
        if events:
            ax.legend(fontsize=7, loc="upper right")
        else:
            ax.text(0.5, 0.5, "no gate: no decisions", transform=ax.transAxes, ha="center", fontsize=9)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
