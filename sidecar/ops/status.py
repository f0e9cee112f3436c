"""The live view for on-call: what the gate holds, why, and how close the lane is to its limit.

One reading is ``/admission/state`` and ``/metrics`` of the admin port at one moment (:class:`Sample`);
two readings give rates (decisions per second by reason, from the counters' difference). :func:`view`
turns readings into a :class:`View` of plain rows, and two renderers draw the same rows:
:func:`render_text` for ``sglang-sidecar status [--watch]`` in a terminal, :func:`render_html` for
``GET /admission/status`` on the admin port (server-rendered, refreshed by a meta tag: no script, no
CDN, works offline).

Plain text, not a terminal UI library: the view is ~40 lines that an on-call engineer pastes into an
incident channel or greps; ``--watch`` redraws with two ANSI codes, and the runtime install stays free
of a rendering dependency.

Alerts: the conditions of ``deploy/prometheus/alerts.yml`` that these two readings can evaluate, the
rate ones over the interval between the readings (Prometheus evaluates them over 5-30 minutes and
waits their ``for:``, so a row here is "would fire if it lasts"). ``SidecarDown`` and
``SidecarNotScraped`` are Prometheus's view of the sidecar, not the sidecar's own.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "sglang_sidecar_"
GIB = 1 << 30
MIB = 1 << 20
# The reject-ratio alert's threshold (alerts.yml: SidecarRejectRatioHigh).
REJECT_RATIO_ALERT = 0.05
# How recent a finding must be for the 30-minute alerts (underestimates, overruns) to count it.
RECENT_S = 1800.0


@dataclass(frozen=True)
class Metrics:
    """The counters and single-series gauges of one ``/metrics`` reading, by name and labels."""

    values: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    @classmethod
    def parse(cls, text: str) -> Metrics:
        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for fam in text_string_to_metric_families(text):
            if not fam.name.startswith(PREFIX):
                continue
            for s in fam.samples:
                if s.name.endswith(("_created", "_bucket")):
                    continue
                out[(s.name[len(PREFIX) :], tuple(sorted(s.labels.items())))] = s.value
        return cls(out)

    def get(self, name: str, **labels: str) -> float | None:
        return self.values.get((name, tuple(sorted(labels.items()))))

    def by(self, name: str, label: str, **fixed: str) -> dict[str, float]:
        """``name``'s series keyed by ``label`` (among those whose other labels are ``fixed``)."""
        out = {}
        for (n, labels), v in self.values.items():
            d = dict(labels)
            if n == name and label in d and all(d.get(k) == x for k, x in fixed.items()):
                out[d[label]] = v
        return out


@dataclass(frozen=True)
class Sample:
    """One reading of the admin port: when (monotonic seconds), its state and its metrics."""

    at: float
    state: dict[str, Any]
    metrics: Metrics


@dataclass
class Section:
    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)
    # "ok", "warn" (attention) or "bad" (an alert's condition): the page colours it, the text marks it.
    level: str = "ok"

    def add(self, label: str, value: str) -> None:
        self.rows.append((label, value))


@dataclass
class View:
    headline: str
    level: str
    sections: list[Section]
    alerts: list[tuple[str, str]]
    interval_s: float | None


# -- formatting -------------------------------------------------------------------------------------


def gib(b: float | None) -> str:
    if b is None:
        return "unknown"
    return f"{b / GIB:,.2f} GiB" if abs(b) >= 256 * MIB else f"{b / MIB:,.0f} MiB"


def secs(s: float | None) -> str:
    return "-" if s is None else f"{s:,.1f} s"


def num(v: float | None, fmt: str = "{:,.0f}") -> str:
    return "unknown" if v is None else fmt.format(v)


def pct(v: float | None) -> str:
    return "unknown" if v is None else f"{v * 100:.1f} %"


# -- the view ---------------------------------------------------------------------------------------


def view(cur: Sample, prev: Sample | None = None) -> View:
    """The rows of the live view; rates and rate alerts need ``prev`` (an earlier reading)."""
    s, m = cur.state, cur.metrics
    dt = cur.at - prev.at if prev is not None and cur.at > prev.at else None
    q = s["queue"]
    gate = "OPEN" if s["gate_open"] else "CLOSED"
    headline = (
        f"{s['policy']['name']} · {s['mode']} · gate {gate}"
        f"{' · DRAINING' if s.get('draining') else ''} · held {q['held']}/{q['max_held']}"
    )
    sections = [
        _decisions(cur, prev, dt),
        _hold(s, m),
        _headroom(s, m),
        _engine(s),
        _monitor(s),
        _measured(s),
    ]
    alerts = alerts_firing(cur, prev)
    level = "bad" if alerts else ("warn" if not s["gate_open"] or q["held"] else "ok")
    return View(headline, level, sections, alerts, dt)


def _delta(cur: dict[str, float], prev: dict[str, float] | None, key: str) -> float:
    return cur.get(key, 0.0) - ((prev or {}).get(key, 0.0))


def _decisions(cur: Sample, prev: Sample | None, dt: float | None) -> Section:
    sec = Section("Decisions " + (f"per second (over the last {dt:.1f} s)" if dt else "since start"))
    m, pm = cur.metrics, prev.metrics if prev is not None else None
    admits = m.by("decisions_total", "reason", decision="admit")
    rejects = m.by("decisions_total", "reason", decision="reject")
    held = m.by("held_total", "reason")
    rows: list[tuple[str, float]] = []
    for name, series, was in (
        ("admit", admits, pm.by("decisions_total", "reason", decision="admit") if pm else None),
        ("reject", rejects, pm.by("decisions_total", "reason", decision="reject") if pm else None),
        ("held", held, pm.by("held_total", "reason") if pm else None),
    ):
        for reason in sorted(series):
            d = _delta(series, was, reason) if dt else series[reason]
            if d or (name == "admit"):
                label = name if name == "admit" else f"{name}: {reason}"
                rows.append((label, d / dt if dt else d))
    for label, v in rows:
        sec.add(label, f"{v:,.2f}/s" if dt else f"{v:,.0f}")
    if any(label.startswith("reject") and v for label, v in rows):
        sec.level = "warn"
    return sec


def _hold(s: dict[str, Any], m: Metrics) -> Section:
    q = s["queue"]
    sec = Section("Hold queue")
    sec.add("held", f"{q['held']} of {q['max_held']} (beyond: queue_full)")
    sec.add("oldest wait", f"{secs(q['oldest_wait_s'])} of {q['max_wait_s']:g} s (beyond: hold_timeout)")
    if q.get("head_waits_for"):
        sec.add(
            "first in line waits for",
            f"{q['head_waits_for']} (projected {gib(q.get('head_projected_bytes'))})",
        )
    since = m.by("held_total", "reason")
    if any(since.values()):
        sec.add(
            "held since start, by reason", ", ".join(f"{r} {v:,.0f}" for r, v in sorted(since.items()) if v)
        )
    if q["held"]:
        sec.level = "warn"
    return sec


def _headroom(s: dict[str, Any], m: Metrics) -> Section:
    """Headroom against the largest projection the gate has admitted: would that request fit now?"""
    sec = Section("GPU memory and headroom")
    head, g = s["headroom_bytes"], s["gpu"]
    largest = m.get("largest_admitted_projection_bytes")
    sec.add("headroom (gate)", gib(head))
    if largest is None:
        sec.add("largest admitted projection", "none admitted yet")
    else:
        fits = head is not None and head >= largest
        times = f" ({head / largest:,.1f}x)" if head is not None and largest > 0 and head > 0 else ""
        sec.add(
            "largest admitted projection", f"{gib(largest)}: {'fits' if fits else 'would NOT fit'} now{times}"
        )
        if not fits:
            sec.level = "warn"
    sec.add(
        "ledger: projected transients",
        f"{gib(s['ledger']['projected_bytes'])} for {s['ledger']['requests']} request(s)",
    )
    sec.add(
        "GPU free (live)", f"{gib(g['free_bytes'])} of {gib(g['total_bytes'])} ({g['source'] or 'no source'})"
    )
    sec.add("other processes", gib(g["other_process_bytes"]))
    reserve = m.get("policy_reserve_bytes")
    idle = s.get("idle_free", {})
    sec.add("reserve (vram.reserve_bytes)", gib(reserve))
    sec.add("headroom from", f"{g['headroom_from']} (idle budget {gib(idle.get('in_force_bytes'))})")
    sec.add("signal age", f"{secs(g['age_s'])}, {g['consecutive_failures']} failure(s) in a row")
    if head is not None and head < 0:
        sec.level = "bad"
    return sec


def _engine(s: dict[str, Any]) -> Section:
    e = s["engine"]
    sec = Section("Engine (last report)")
    sec.add("running / waiting", f"{num(e['running_requests'])} / {num(e['queue_requests'])}")
    sec.add("KV usage (full)", pct(e["full_token_usage"]))
    if e.get("mamba_usage") is not None:
        sec.add("Mamba usage", f"{pct(e['mamba_usage'])} ({num(e['mamba_available_slots'])} slots free)")
    sec.add("KV available", f"{num(e['kv_available_tokens'])} tokens")
    sec.add("pending prefill", f"{num(e['pending_prefill_tokens'])} tokens")
    sec.add("signal age", f"{secs(e['age_s'])}, {e['consecutive_failures']} failure(s) in a row")
    if e["consecutive_failures"]:
        sec.level = "bad"
        if e.get("last_error"):
            sec.add("last error", str(e["last_error"]))
    return sec


def _monitor(s: dict[str, Any]) -> Section:
    mon = s.get("monitor") or {}
    sec = Section("Monitor (projection vs GPU readings)")
    margin = mon.get("margin") or {}
    if margin:
        raised = margin.get("raised")
        text = f"{margin.get('effective')} in force (policy {margin.get('policy')})"
        if raised:
            text += f", raised since {margin.get('since') or '?'}"
            sec.level = "warn"
        sec.add("cost margin", text)
        if raised and margin.get("why"):
            sec.add("why", str(margin["why"]))
    sec.add(
        "under-estimates", f"{mon.get('underestimates', 0)} (worst ratio {mon.get('worst_ratio') or '-'})"
    )
    guard = s.get("guard") or {}
    if guard:
        sec.add("guard aborts", f"{guard.get('aborted', 0)} (prefilling now: {guard.get('prefilling', 0)})")
    return sec


def _measured(s: dict[str, Any]) -> Section:
    """Every figure the state gives as the policy's beside a measured one: what is there, nothing
    more (a section without one is skipped, so a newer state's facts appear on their own)."""
    sec = Section("Measured vs policy")
    for path, d in _policy_measured(s):
        measured = d.get("measured", d.get("measured_bytes"))
        is_bytes = "bytes" in path or "measured_bytes" in d or path.endswith("idle_free")
        fmt = gib if is_bytes else (lambda v: num(v, "{:,}"))
        text = f"policy {fmt(d['policy'])}, measured {'not yet' if measured is None else fmt(measured)}"
        if d.get("in_force") is not None or d.get("in_force_bytes") is not None:
            text += f", in force {fmt(d.get('in_force', d.get('in_force_bytes')))}"
        if d.get("disagrees") or d.get("unsafe"):
            text += " · DISAGREES" + (" (the policy's is unsafe)" if d.get("unsafe") else "")
            sec.level = "warn"
        sec.add(path, text)
    if not sec.rows:
        sec.add("(none reported)", "")
    return sec


def _policy_measured(d: Any, path: str = "") -> Iterable[tuple[str, dict[str, Any]]]:
    if not isinstance(d, dict):
        return
    if "policy" in d and ("measured" in d or "measured_bytes" in d) and not isinstance(d["policy"], dict):
        yield path or "state", d
        return
    for k, v in d.items():
        if k != "policy" or isinstance(v, dict):
            yield from _policy_measured(v, f"{path}.{k}" if path else k)


# -- alerts -----------------------------------------------------------------------------------------


def alerts_firing(cur: Sample, prev: Sample | None) -> list[tuple[str, str]]:
    """(alert, why) for each rule of alerts.yml whose condition holds in these readings."""
    s, m = cur.state, cur.metrics
    pm = prev.metrics if prev is not None else None
    out: list[tuple[str, str]] = []
    if not s["gate_open"]:
        out.append(("SidecarGateClosed", "the gate admits nothing now (fires after 10 minutes of it)"))
    ratio = _reject_ratio(m, pm)
    if ratio is not None and ratio > REJECT_RATIO_ALERT:
        out.append(
            (
                "SidecarRejectRatioHigh",
                f"{ratio * 100:.0f} % of decisions {'since the last reading' if pm else 'since start'} were rejections",
            )
        )
    out += _stale(s, m)
    if s["headroom_bytes"] is not None and s["headroom_bytes"] < 0:
        out.append(
            (
                "SidecarHeadroomBelowReserve",
                f"headroom {gib(s['headroom_bytes'])} (fires after 2 minutes of it)",
            )
        )
    timeouts = _increase(m, pm, "decisions_total", decision="reject", reason="hold_timeout")
    if timeouts:
        out.append(("SidecarHoldTimeouts", f"{timeouts:.0f} held request(s) timed out"))
    if m.get("policy_last_reload_successful") == 0:
        out.append(("SidecarPolicyReloadFailing", "the last reload was refused; the previous policy runs"))
    dropped = _increase(m, pm, "decision_log_dropped_total") + _increase(m, pm, "log_lines_dropped_total")
    if dropped:
        out.append(("SidecarLogLinesDropped", f"{dropped:.0f} log line(s) dropped"))
    last = (s.get("monitor") or {}).get("last")
    if last is not None and last.get("age_s") is not None and last["age_s"] < RECENT_S:
        out.append(("SidecarProjectionUnderestimated", f"last finding {last['age_s']:.0f} s ago"))
    overrun = ((s.get("guard") or {}).get("last")) or None
    if overrun is not None and overrun.get("age_s") is not None and overrun["age_s"] < RECENT_S:
        out.append(("SidecarPrefillOverrun", f"last abort {overrun['age_s']:.0f} s ago"))
    disagree = sorted(
        {
            dict(lb).get("fact", "?")
            for (n, lb), v in m.values.items()
            if n == "lane_fact_disagreement" and v == 1
        }
    )
    if disagree:
        out.append(
            ("SidecarPolicyDisagreesWithLane", f"{', '.join(disagree)}: the lane's figure is in force")
        )
    crashes = _increase(m, pm, "engine_crashes_total")
    if crashes:
        out.append(("SidecarEngineCrashedUnderLoad", f"{crashes:.0f} engine crash(es) with work admitted"))
    if m.get("engine_build_unconfirmed") == 1:
        out.append(
            ("SidecarEngineBuildUnconfirmed", "a new engine build is priced conservatively until confirmed")
        )
    return out


def _increase(m: Metrics, pm: Metrics | None, name: str, **labels: str) -> float:
    """A counter's increase since the earlier reading (its total without one: since start)."""
    now = m.get(name, **labels) or 0.0
    return now - ((pm.get(name, **labels) or 0.0) if pm is not None else 0.0)


def _reject_ratio(m: Metrics, pm: Metrics | None) -> float | None:
    def totals(x: Metrics | None) -> tuple[float, float]:
        if x is None:
            return 0.0, 0.0
        adm = sum(x.by("decisions_total", "reason", decision="admit").values())
        rej = x.by("decisions_total", "reason", decision="reject")
        bad = sum(v for r, v in rej.items() if r != "draining")
        return bad, adm + sum(rej.values())

    bad, total = totals(m)
    pbad, ptotal = totals(pm)
    if total - ptotal <= 0:
        return None
    return (bad - pbad) / (total - ptotal)


def _stale(s: dict[str, Any], m: Metrics) -> list[tuple[str, str]]:
    out = []
    limits = m.by("policy_signal_max_age_seconds", "signal")
    for sig in ("engine", "gpu"):
        part = s[sig]
        age, limit = part["age_s"], limits.get(sig)
        if age is not None and limit is not None and age > limit:
            out.append(
                (
                    "SidecarSignalStale",
                    f"{sig} signal {age:.1f} s old (max_age_s {limit:g}; fires after 1 minute of it)",
                )
            )
        elif age is None and part["consecutive_failures"]:
            out.append(
                ("SidecarSignalStale", f"{sig} signal never read ({part['consecutive_failures']} failures)")
            )
    return out


# -- rendering --------------------------------------------------------------------------------------

_MARK = {"ok": " ", "warn": "!", "bad": "X"}


def render_text(v: View, width: int = 34) -> str:
    """The terminal view: a headline, the alerts, then each section's rows as ``label  value``."""
    lines = [v.headline, "=" * min(len(v.headline), 100)]
    if v.alerts:
        lines.append("ALERTS that would fire:")
        lines += [f"  X {name}: {why}" for name, why in v.alerts]
    else:
        lines.append("alerts: none would fire")
    for sec in v.sections:
        lines.append("")
        lines.append(f"{_MARK[sec.level]} {sec.title}")
        lines += [f"    {label:<{width}} {value}".rstrip() for label, value in sec.rows]
    return "\n".join(lines) + "\n"


_CSS = """
body{font:15px/1.4 system-ui,sans-serif;margin:1.2em;background:#fafafa;color:#111}
h1{font-size:1.35em;margin:0 0 .4em}
.ok h1{color:#14532d}.warn h1{color:#92400e}.bad h1{color:#991b1b}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(26em,1fr));gap:.8em}
section{background:#fff;border:1px solid #ddd;border-left:6px solid #16a34a;padding:.4em .8em;border-radius:4px}
section.warn{border-left-color:#d97706}section.bad{border-left-color:#dc2626}
h2{font-size:1.05em;margin:.2em 0 .4em}
table{border-collapse:collapse;width:100%}td{padding:.1em .4em;vertical-align:top}
td:first-child{color:#555;white-space:nowrap;width:45%}td:last-child{font-variant-numeric:tabular-nums}
#alerts{margin:.6em 0}#alerts li{color:#991b1b;font-weight:600}
.note{color:#666;font-size:.85em;margin-top:1em}
"""


def render_html(v: View, refresh_s: float = 2.0, at: str = "") -> str:
    """The same rows as one HTML page, refreshed every ``refresh_s`` by a meta tag (no script);
    ``at``: when it was read (shown, so a page left open on a stopped sidecar says how old it is)."""
    e = html.escape
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f'<meta http-equiv="refresh" content="{max(1, math.ceil(refresh_s))}">',
        f"<title>{e(v.headline)}</title><style>{_CSS}</style></head>",
        f'<body class="{v.level}"><h1 id=headline>{e(v.headline)}</h1>',
    ]
    if v.alerts:
        items = "".join(f"<li><b>{e(n)}</b>: {e(w)}</li>" for n, w in v.alerts)
        parts.append(f"<ul id=alerts>{items}</ul>")
    else:
        parts.append("<p id=alerts>No alert would fire.</p>")
    parts.append('<div class="grid">')
    for sec in v.sections:
        rows = "".join(f"<tr><td>{e(label)}</td><td>{e(value)}</td></tr>" for label, value in sec.rows)
        parts.append(f'<section class="{sec.level}"><h2>{e(sec.title)}</h2><table>{rows}</table></section>')
    parts.append("</div>")
    parts.append(
        f'<p class="note">Read {e(at)}: /admission/state and /metrics of this admin port, '
        f"refreshed every {refresh_s:g} s. The same in a terminal: <code>sglang-sidecar status --watch</code>.</p>"
    )
    parts.append("</body></html>")
    return "".join(parts)


# -- reading a running sidecar ----------------------------------------------------------------------


class Unreachable(Exception):
    """The admin port did not answer, or not with a sidecar's state."""


def read_sample(client: Any, admin_url: str, clock: Any) -> Sample:
    """One reading of ``admin_url`` (``httpx.Client``): its state, then its metrics."""
    import httpx

    base = admin_url.rstrip("/")
    try:
        st = client.get(base + "/admission/state")
        mt = client.get(base + "/metrics")
    except httpx.HTTPError as e:
        raise Unreachable(f"cannot read {base}: {type(e).__name__}: {e}".rstrip(": ")) from None
    for r in (st, mt):
        if r.status_code != 200:
            raise Unreachable(f"{r.request.url} answered {r.status_code}: is {base} a sidecar's admin port?")
    try:
        state = st.json()
        state["queue"], state["gate_open"]  # a sidecar's state has both
    except (ValueError, KeyError, TypeError):
        raise Unreachable(f"{base}/admission/state is not a sidecar's state") from None
    return Sample(clock(), state, Metrics.parse(mt.text))
