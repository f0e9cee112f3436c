"""One picture per replay: why the gate did what it did, on one time axis.

Rows: GPU memory (crashes marked and explained); KV and Mamba usage with the policy's limits; the
engine's queue and the sidecar's held queue with theirs; each decision by reason (gated runs only).
In a gated run the memory row stacks what the gate counts, bottom to top: the policy's reserve, the
ledger's projected transients, other processes' growth beyond the policy's figure, and the headroom
left; the stack's top is the budget the gate starts from (the idle budget, or live GPU free). With
``vram.headroom: idle_budget`` a caching engine's live GPU free memory sits near 0 while the headroom
shows a GiB: the panel says so in words, since that is the first question a postmortem asks.
Gated and ungated runs share the time axis and every row's scale, so the columns compare at a glance;
the time axis ends shortly after the last thing happened. Replaying a decision log (``start_unix``),
the axis reads UTC wall-clock time, the log's own. Text is 10 pt or more.
matplotlib is imported here only, with the Agg backend: no display needed.
"""

from __future__ import annotations

import textwrap
import time
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


FONTS = {
    "font.size": 11,
    "axes.titlesize": 12,
    "axes.labelsize": 11,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "legend.fontsize": 10,
    "figure.titlesize": 13,
}
MIB = 1 << 20


def usage_limit(ax: Any, name: str, value: float, color: str) -> None:
    """A policy's usage ceiling as a dotted line on a usage panel."""
    ax.axhline(value, color=color, ls=":", lw=1.2, label=f"{name} {value:g}")


def plot_replay(
    results: dict[str, dict[str, Any]],
    out: str,
    title: str = "",
    policy: Any = None,
    start_unix: float | None = None,
) -> None:
    """Draw the replay and write it to ``out`` (.png, .svg or .pdf); OSError if it cannot be written."""
    fig = build_figure(results, title, policy, start_unix)  # selects the Agg backend before pyplot
    import matplotlib.pyplot as plt

    try:
        fig.savefig(out, dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)


def build_figure(
    results: dict[str, dict[str, Any]], title: str = "", policy: Any = None, start_unix: float | None = None
) -> Any:
    """The figure itself (tests look at its axes); ``policy`` draws its limits on the gated runs;
    ``start_unix``: the wall-clock time of t = 0 (a decision log's first line), for a UTC time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with matplotlib.rc_context(FONTS):
        runs = list(results.items())
        rows = 4 if any(r["gate"] and r.get("decision_events") for _, r in runs) else 3
        fig, axes = plt.subplots(
            rows,
            len(runs),
            figsize=(8.5 * len(runs), 3.5 + 3.0 * rows),
            sharex=True,
            squeeze=False,
            gridspec_kw={"height_ratios": [3.4, 2, 2, 2][:rows]},
        )
        # The same scale per row across the columns (the decision row lists each run's own reasons).
        for row in range(min(rows, 3)):
            for col in range(1, len(runs)):
                axes[row][col].sharey(axes[row][0])
        end = _end_of_activity(results)
        top = _memory_top(runs, end)
        xlabel = _time_axis(axes[0][0], start_unix)
        for col, (label, r) in enumerate(runs):
            last = col == len(runs) - 1
            _memory_panel(axes[0][col], label, r, policy, top, last)
            _usage_panel(axes[1][col], r, policy, last)
            _queue_panel(axes[2][col], r, policy, last)
            bottom = rows - 1
            if rows == 4 and not _decision_panel(axes[3][col], r, last):
                axes[3][col].set_visible(False)  # an ungated run decides nothing: no empty panel
                axes[2][col].tick_params(labelbottom=True)
                bottom = 2
            axes[bottom][col].set_xlabel(xlabel)
        axes[0][0].set_xlim(0, end)
        if title:
            fig.suptitle(title + _wall_span(start_unix, end))
        fig.tight_layout()
    return fig


def _legend(ax: Any, last: bool) -> None:
    # Outside the last column, so it never hides a line; the columns share colours and labels.
    if last:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _time_axis(ax: Any, start_unix: float | None) -> str:
    """Seconds since the start, or (a decision log) UTC clock times; returns the axis label."""
    if start_unix is None:
        return "virtual time (s)"
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: _clock(start_unix + x)))
    day = time.strftime("%Y-%m-%d", time.gmtime(start_unix))
    return f"time (UTC, {day}; the decision log's own clock)"


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ts))


def _wall_span(start_unix: float | None, end: float) -> str:
    if start_unix is None:
        return ""
    day = time.strftime("%Y-%m-%d", time.gmtime(start_unix))
    return f"\nreplayed from the decision log of {day} {_clock(start_unix)}-{_clock(start_unix + end)} UTC"


def _memory_top(runs: list[tuple[str, dict[str, Any]]], end: float) -> float:
    """One memory scale for every column (GiB): the running engine's free memory and what the gate
    counts (while the engine is down after a crash its memory is all free and would flatten the rest)."""
    top = GIB
    for _, r in runs:
        s = r["series"]
        down = r.get("restart_s", 0)
        for v, tt in zip(s["free_bytes"], s["t"], strict=True):
            if tt <= end and not any(c["t"] <= tt < c["t"] + down for c in r["crashes"]):
                top = max(top, v)
        for v in s.get("other_process_bytes", []):
            top = max(top, v or 0)
        for h, p in zip(s["headroom_bytes"], s["ledger_projected_bytes"], strict=True):
            top = max(top, (h or 0) + (p or 0))
    return top / GIB * 1.35


def _memory_panel(ax: Any, label: str, r: dict[str, Any], policy: Any, top: float, last: bool) -> None:
    s, t = r["series"], r["series"]["t"]
    ax.set_title(
        f"{label}: {len(r['crashes'])} crash(es), {r['completed']} completed, {r['rejected']} rejected"
    )
    if r["gate"]:
        _headroom_stack(ax, s, policy)
    ax.plot(t, [v / GIB for v in s["free_bytes"]], lw=1.4, color="tab:blue", label="GPU free (live, NVML)")
    other = s.get("other_process_bytes") or []
    if any(v for v in other):
        ax.plot(
            t,
            [None if v is None else v / GIB for v in other],
            lw=1.2,
            color="tab:purple",
            label="other processes on the card",
        )
    ax.set_ylim(0, top)
    _crashes(ax, r, top)
    ax.set_ylabel("GiB")
    _legend(ax, last)


def _headroom_stack(ax: Any, s: dict[str, list[Any]], policy: Any) -> None:
    """What the gate counts, stacked: reserve, projected transients, what other processes took beyond
    the policy's figure (idle budget only), headroom left. The stack's top is the gate's budget."""
    reserve = policy.vram.reserve_bytes if policy is not None else 0
    idle_budget = policy is not None and policy.vram.headroom.value == "idle_budget"
    t = s["t"]
    known = [h is not None for h in s["headroom_bytes"]]
    layers = [
        [reserve / GIB if k else 0.0 for k in known],
        [(p or 0) / GIB for p in s["ledger_projected_bytes"]],
    ]
    labels = [f"reserve ({reserve / MIB:,.0f} MiB, never handed out)", "ledger: projected transients"]
    colors = ["dimgrey", "tab:orange"]
    headroom = [max(h or 0, 0) / GIB for h in s["headroom_bytes"]]
    figure = policy.vram.idle_free_figure if idle_budget else None
    if figure is not None and policy.vram.other_processes_bytes is not None:
        # The budget is the policy's figure: what the stack lacks of it went to other processes'
        # growth (as the gate read it, with its GPU signal's lag).
        taken = [
            max(0.0, figure / GIB - r - p - h) if k else 0.0
            for r, p, h, k in zip(*layers, headroom, known, strict=True)
        ]
        if any(v > 1e-3 for v in taken):
            layers.append(taken)
            labels.append("other processes' growth (taken from the budget)")
            colors.append("plum")
    layers.append(headroom)
    labels.append("gate headroom (what it can still admit)")
    colors.append("tab:green")
    ax.stackplot(t, *layers, labels=labels, colors=colors, alpha=0.35, step="post")
    budget = [sum(v) for v in zip(*layers, strict=True)]
    name = "idle budget in force" if idle_budget else "budget: live GPU free"
    ax.step(t, budget, where="post", lw=1.2, color="black", ls="--", label=name)
    if reserve:
        # A few MiB vanish at the GiB scale: a line and a pointer keep the reserve visible.
        ax.axhline(
            reserve / GIB, color="dimgrey", ls=":", lw=1.5, label=f"reserve ({reserve / MIB:,.0f} MiB)"
        )
        ax.annotate(
            f"reserve {reserve / MIB:,.0f} MiB",
            xy=(0.995, reserve / GIB),
            xycoords=("axes fraction", "data"),
            xytext=(-4, 14),
            textcoords="offset points",
            ha="right",
            fontsize=10,
            color="dimgrey",
            arrowprops={"arrowstyle": "->", "color": "dimgrey"},
        )
    if idle_budget:
        idle = (figure if figure is not None else max(budget, default=0) * GIB) / GIB
        ax.text(
            1.01,
            0.0,
            "\n".join(
                textwrap.wrap(
                    f"Why GPU free sits near 0 while the headroom shows GiBs: the caching allocator keeps "
                    f"what prefills freed, so live free memory stays at its low-water mark. The gate counts "
                    f"the idle budget instead ({idle:,.2f} GiB, measured with the engine idle; "
                    "vram.headroom: idle_budget) minus the reserve, the projected transients and other "
                    "processes' growth: the stack.",
                    52,
                )
            ),
            transform=ax.transAxes,
            va="bottom",
            fontsize=10,
            bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "lightgrey"},
        )


def _crashes(ax: Any, r: dict[str, Any], top: float) -> None:
    downtime = r.get("restart_s", 0)
    for i, c in enumerate(r["crashes"]):
        ax.axvspan(c["t"], c["t"] + downtime, color="red", alpha=0.08)
        ax.axvline(c["t"], color="red", lw=1.5)
        ax.annotate(
            _crash_text(c),
            (c["t"], top * (0.97 - 0.2 * i)),
            xytext=(4, 0),
            textcoords="offset points",
            color="darkred",
            fontsize=10,
            va="top",
        )


def _usage_panel(ax: Any, r: dict[str, Any], policy: Any, last: bool) -> None:
    s, t = r["series"], r["series"]["t"]
    ax.plot(t, s["full_usage"], lw=1.2, label="KV (full) usage")
    if any(v is not None for v in s["mamba_usage"]):
        ax.plot(t, s["mamba_usage"], lw=1.2, label="Mamba usage")
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
    _legend(ax, last)


def _queue_panel(ax: Any, r: dict[str, Any], policy: Any, last: bool) -> None:
    from matplotlib.ticker import MaxNLocator

    s, t = r["series"], r["series"]["t"]
    ax.step(t, s["engine_queue"], where="post", lw=1.2, label="engine waiting queue")
    ax.step(t, s["running"], where="post", lw=1.2, label="engine running")
    if r["gate"]:
        ax.step(t, s["held"], where="post", lw=1.2, label="sidecar held")
        if policy is not None:
            ax.axhline(
                policy.engine_queue.max_requests,
                color="tab:blue",
                ls=":",
                lw=1.2,
                label=f"engine_queue.max_requests {policy.engine_queue.max_requests}",
            )
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("requests")
    _legend(ax, last)


def _decision_panel(ax: Any, r: dict[str, Any], last: bool) -> bool:
    """Each decision by reason; False when the run decided nothing (the caller hides the panel)."""
    events = r.get("decision_events", [])
    if not (r["gate"] and events):
        return False
    colors = {"admit": "tab:green", "hold": "tab:orange", "reject": "tab:red"}
    used = sorted({e[2] or "admit" for e in events}, key=REASON_ROWS.index)
    for action in ("admit", "hold", "reject"):
        xs = [e[0] for e in events if e[1] == action]
        ys = [used.index(e[2] or "admit") for e in events if e[1] == action]
        if xs:
            ax.scatter(xs, ys, s=14, color=colors[action], label=action)
    ax.set_yticks(range(len(used)), used, fontsize=10)
    ax.set_ylim(-0.5, len(used) - 0.5)
    _legend(ax, last)
    return True
