"""One picture per replay: why the gate did what it did, on one time axis.

Rows: free VRAM with the gate's headroom, the ledger's projected transients, other processes' memory
and the policy's reserve (crashes marked and explained); KV and Mamba usage with the policy's limits;
the engine's queue and the sidecar's held queue with theirs; each decision by reason (gated runs only).
Gated and ungated runs share the time axis and every row's scale, so the columns compare at a glance;
the time axis ends shortly after the last thing happened.
matplotlib is imported here only, with the Agg backend: no display needed.
"""

from __future__ import annotations

import textwrap
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


def _end_of_activity(results: dict[str, dict[str, Any]]) -> float:
    """Last time anything happened in any run (a decision, a crash, a non-idle engine), plus a margin."""
    last = 0.0
    for r in results.values():
        s = r["series"]
        for i, t in enumerate(s["t"]):
            if s["running"][i] or s["engine_queue"][i] or s["held"][i] or s["ledger_projected_bytes"][i]:
                last = max(last, t)
        for e in r.get("decision_events", []):
            last = max(last, e[0])
        for c in r["crashes"]:
            last = max(last, c["t"] + min(r.get("restart_s", 0), 60))
    return last * 1.05 + 5 if last else max((r["series"]["t"][-1] for r in results.values()), default=1)


def _crash_text(c: dict[str, Any]) -> str:
    text = f"crash at {c['t']:.0f} s: {c['reason']}"
    if c.get("requested_bytes") is not None and c.get("free_bytes") is not None:
        text += f" [{c['requested_bytes'] / (1 << 20):,.0f} MiB asked, {c['free_bytes'] / (1 << 20):,.0f} MiB free]"
    if c.get("failed_requests"):
        text += f"; {c['failed_requests']} requests failed"
    return "\n".join(textwrap.wrap(text, 60))


def usage_limit(ax: Any, name: str, value: float, color: str) -> None:
    """A policy's usage ceiling as a dotted line on a usage panel."""
    ax.axhline(value, color=color, ls=":", lw=1, label=f"{name} {value:g}")


def plot_replay(results: dict[str, dict[str, Any]], out: str, title: str = "", policy: Any = None) -> None:
    """Draw the replay and write it to ``out`` (.png, .svg or .pdf); OSError if it cannot be written."""
    fig = build_figure(results, title, policy)  # selects the Agg backend before pyplot is imported
    import matplotlib.pyplot as plt

    try:
        fig.savefig(out, dpi=90, bbox_inches="tight")
    finally:
        plt.close(fig)


def build_figure(results: dict[str, dict[str, Any]], title: str = "", policy: Any = None) -> Any:
    """The figure itself (tests look at its axes); ``policy`` draws its limits on the gated runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = list(results.items())
    gated_any = any(r["gate"] and r.get("decision_events") for _, r in runs)
    rows = 4 if gated_any else 3
    fig, axes = plt.subplots(
        rows,
        len(runs),
        figsize=(7 * len(runs), 3 + 2.6 * rows),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 2, 2, 2][:rows]},
    )
    # The same scale per row across the columns (the decision row lists each run's own reasons).
    for row in range(min(rows, 3)):
        for col in range(1, len(runs)):
            axes[row][col].sharey(axes[row][0])
    end = _end_of_activity(results)

    def legend(ax: Any, col: int) -> None:
        # Outside the last column, so it never hides a line; the columns share colours and labels.
        if col == len(runs) - 1:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)

    # One memory scale for every column: the running engine's free memory (while it is down after a
    # crash its memory is all free and would flatten everything else).
    top = GIB
    for _, r in runs:
        s = r["series"]
        down = r.get("restart_s", 0)
        for v, tt in zip(s["free_bytes"], s["t"], strict=True):
            if tt <= end and not any(c["t"] <= tt < c["t"] + down for c in r["crashes"]):
                top = max(top, v)
        for v in s.get("other_process_bytes", []):
            top = max(top, v or 0)
    top = top / GIB * 1.3
    for col, (label, r) in enumerate(runs):
        s = r["series"]
        t = s["t"]
        ax = axes[0][col]
        ax.set_title(
            f"{label}: {len(r['crashes'])} crash(es), {r['completed']} completed, {r['rejected']} rejected",
            fontsize=10,
        )
        ax.plot(t, [v / GIB for v in s["free_bytes"]], lw=1, color="tab:blue", label="GPU free")
        other = s.get("other_process_bytes") or []
        if any(v for v in other):
            ax.plot(
                t,
                [None if v is None else v / GIB for v in other],
                lw=1,
                color="tab:purple",
                label="other processes on the card",
            )
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
            if policy is not None and policy.vram.reserve_bytes:
                ax.axhline(
                    policy.vram.reserve_bytes / GIB,
                    color="grey",
                    ls=":",
                    lw=1,
                    label=f"reserve ({policy.vram.reserve_bytes / (1 << 20):,.0f} MiB)",
                )
        ax.set_ylim(0, top)
        downtime = r.get("restart_s", 0)
        for i, c in enumerate(r["crashes"]):
            ax.axvspan(c["t"], c["t"] + downtime, color="red", alpha=0.08)
            ax.axvline(c["t"], color="red", lw=1.5)
            ax.annotate(
                _crash_text(c),
                (c["t"], top * (0.97 - 0.18 * i)),
                xytext=(4, 0),
                textcoords="offset points",
                color="darkred",
                fontsize=7,
                va="top",
            )
        ax.set_ylabel("GiB")
        legend(ax, col)

        ax = axes[1][col]
        ax.plot(t, s["full_usage"], lw=1, label="KV (full) usage")
        if any(v is not None for v in s["mamba_usage"]):
            ax.plot(t, s["mamba_usage"], lw=1, label="Mamba usage")
        if r["gate"] and policy is not None:
            if policy.kv.max_usage < 1:
                usage_limit(ax, "kv.max_usage", policy.kv.max_usage, "tab:blue")
            if (
                policy.mamba is not None
                and policy.mamba.max_usage < 1
                and any(v is not None for v in s["mamba_usage"])
            ):
                usage_limit(ax, "mamba.max_usage", policy.mamba.max_usage, "tab:orange")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("usage")
        legend(ax, col)

        ax = axes[2][col]
        ax.step(t, s["engine_queue"], where="post", lw=1, label="engine waiting queue")
        ax.step(t, s["running"], where="post", lw=1, label="engine running")
        if r["gate"]:
            ax.step(t, s["held"], where="post", lw=1, label="sidecar held")
            if policy is not None:
                ax.axhline(
                    policy.engine_queue.max_requests,
                    color="tab:blue",
                    ls=":",
                    lw=1,
                    label=f"engine_queue.max_requests {policy.engine_queue.max_requests}",
                )
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("requests")
        legend(ax, col)

        if rows == 4:
            ax = axes[3][col]
            events = r.get("decision_events", [])
            if not (r["gate"] and events):
                ax.set_visible(False)  # an ungated run decides nothing: no empty panel
                axes[2][col].tick_params(labelbottom=True)
                axes[2][col].set_xlabel("virtual time (s)")
                continue
            colors = {"admit": "tab:green", "hold": "tab:orange", "reject": "tab:red"}
            used = sorted({e[2] or "admit" for e in events}, key=REASON_ROWS.index)
            for action in ("admit", "hold", "reject"):
                xs = [e[0] for e in events if e[1] == action]
                ys = [used.index(e[2] or "admit") for e in events if e[1] == action]
                if xs:
                    ax.scatter(xs, ys, s=10, color=colors[action], label=action)
            ax.set_yticks(range(len(used)), used, fontsize=7)
            ax.set_ylim(-0.5, len(used) - 0.5)
            legend(ax, col)
        axes[rows - 1][col].set_xlabel("virtual time (s)")
    axes[0][0].set_xlim(0, end)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
