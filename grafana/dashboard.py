"""The sglang-sidecar dashboard, built with Grafana's own types (grafana-foundation-sdk).

    python grafana/dashboard.py          # writes grafana/dashboards/sglang-sidecar.json
    python grafana/dashboard.py --check  # exit 1 when the committed JSON is not what this file builds

The committed JSON is what Grafana provisions; this file is its source, and a test fails when the two
disagree. Every query selects ``lane`` and ``instance`` from the dashboard's variables, and every panel
uses the ``${datasource}`` variable: no datasource uid is written down.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as d
from grafana_foundation_sdk.builders import heatmap, stat, timeseries
from grafana_foundation_sdk.builders.common import ReduceDataOptions
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as m
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

UID = "sglang-sidecar"
OUT = Path(__file__).resolve().parent / "dashboards" / "sglang-sidecar.json"
DS = m.DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'lane=~"$lane", instance=~"$instance"'
P = "sglang_sidecar_"
DOCS = "docs/operate.md#the-dashboard"


def q(expr: str, legend: str = "", ref: str = "A") -> Dataquery:
    return Dataquery().expr(expr).legend_format(legend or "__auto").ref_id(ref).datasource(DS).range()


def s(metric: str, extra: str = "") -> str:
    """A selector of one sidecar metric on the chosen lanes and instances."""
    return f"{P}{metric}{{{SEL}{', ' + extra if extra else ''}}}"


def quantiles(bucket: str, at: tuple[float, ...] = (0.5, 0.95, 0.99)) -> list[Dataquery]:
    """p50/p95/p99 of one sidecar histogram across the chosen lanes (one query per quantile)."""
    return [
        q(f"histogram_quantile({x}, sum by (le) (rate({s(bucket)}[$__rate_interval])))", f"p{round(x * 100)}")
        for x in at
    ]


def series(
    title: str, unit: str, *targets: Dataquery, desc: str = "", w: int = 12, h: int = 8
) -> timeseries.Panel:
    p = timeseries.Panel().title(title).unit(unit).datasource(DS).span(w).height(h).description(desc)
    for i, t in enumerate(targets):
        p = p.with_target(t.ref_id(chr(ord("A") + i)))
    return p


def limit_line(p: timeseries.Panel, name_regex: str) -> timeseries.Panel:
    """Draw a policy limit as a dashed red line, so a value against its limit reads at a glance."""
    return p.override_by_regexp(
        name_regex,
        [
            m.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
            m.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": "red"}),
            m.DynamicConfigValue(id_val="custom.fillOpacity", value=0),
        ],
    )


def last_value(p: stat.Panel) -> stat.Panel:
    """A stat shows the latest value of each series, not a mean over the time range."""
    return p.reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False)).graph_mode(
        common.BigValueGraphMode.NONE
    )


def pick(name: str, label: str, values: str) -> d.QueryVariable:
    """A variable of label values, several or all at once (all = the regex ``.*``)."""
    return (
        d.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query({"query": values, "refId": name})
        .refresh(m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(m.VariableOption(selected=True, text="All", value="$__all"))
    )


def two_states(zero: tuple[str, str], one: tuple[str, str]) -> list[m.ValueMap]:
    """A 0/1 gauge shown as words in colour: (text, colour) for 0 and for 1."""
    return [
        m.ValueMap(
            options={
                "0": m.ValueMappingResult(text=zero[0], color=zero[1]),
                "1": m.ValueMappingResult(text=one[0], color=one[1]),
            }
        )
    ]


def thresholds(*steps: tuple[float | None, str]) -> d.ThresholdsConfig:
    return (
        d.ThresholdsConfig()
        .mode(m.ThresholdsMode.ABSOLUTE)
        .steps([m.Threshold(value=v, color=c) for v, c in steps])
    )


def build() -> d.Dashboard:
    gate = (
        last_value(stat.Panel())
        .title("Gate open")
        .description("1 when a minimal request would be admitted now and nobody waits ahead of it.")
        .datasource(DS)
        .span(4)
        .height(4)
        .with_target(q(f"max by (lane, instance) ({s('gate_open')})", "{{lane}} {{instance}}"))
        .mappings(two_states(("CLOSED", "red"), ("open", "green")))
        .thresholds(thresholds((None, "red"), (1, "green")))
        .color_mode(common.BigValueColorMode.BACKGROUND)
    )
    held_now = (
        last_value(stat.Panel())
        .title("Held now")
        .datasource(DS)
        .span(4)
        .height(4)
        .unit("short")
        .with_target(q(f"sum by (lane, instance) ({s('held_requests')})", "{{lane}} {{instance}}"))
        .thresholds(thresholds((None, "green"), (1, "orange")))
    )
    policy = (
        last_value(stat.Panel())
        .title("Policy in force")
        .description("policy_info{name,sha256}; a change of sha256 is a reload.")
        .datasource(DS)
        .span(8)
        .height(4)
        .with_target(q(f"max by (lane, instance, name, sha256) ({s('policy_info')})", "{{name}} {{sha256}}"))
        .text_mode(common.BigValueTextMode.NAME)
        .color_mode(common.BigValueColorMode.NONE)
    )
    reload_ok = (
        last_value(stat.Panel())
        .title("Last policy reload")
        .datasource(DS)
        .span(4)
        .height(4)
        .with_target(q(f"min by (lane, instance) ({s('policy_last_reload_successful')})", "{{instance}}"))
        .mappings(two_states(("REFUSED", "red"), ("ok", "green")))
        .color_mode(common.BigValueColorMode.BACKGROUND)
    )
    stale = (
        last_value(stat.Panel())
        .title("Signal age / max age")
        .description("Above 1 the signal is stale and the gate does what the policy's on_stale says.")
        .datasource(DS)
        .span(4)
        .height(4)
        .unit("percentunit")
        .with_target(
            q(
                f"max by (lane, instance, signal) ({s('signal_age_seconds')}"
                f" / on (job, instance, signal) {s('policy_signal_max_age_seconds')})",
                "{{signal}}",
            )
        )
        .thresholds(thresholds((None, "green"), (0.8, "orange"), (1, "red")))
        .color_mode(common.BigValueColorMode.BACKGROUND)
    )

    decisions = series(
        "Decisions per second",
        "reqps",
        q(
            f"sum by (decision, reason) (rate({s('decisions_total')}[$__rate_interval]))",
            "{{decision}} {{reason}}",
        ),
        q(f"sum by (reason) (rate({s('held_total')}[$__rate_interval]))", "held {{reason}}"),
        desc="Final decisions (admit, or reject by reason), and requests parked in the hold queue by "
        "what they wait for. A held request that is later admitted shows once in each.",
    )
    outcomes = series(
        "Requests per second by outcome",
        "reqps",
        q(f"sum by (outcome) (rate({s('requests_total')}[$__rate_interval]))", "{{outcome}}"),
        desc="Every gated request once, by how it ended.",
    )
    memory = limit_line(
        series(
            "GPU memory: free, headroom, projected, reserve",
            "bytes",
            q(f"min by (lane, instance) ({s('gpu_free_bytes')})", "GPU free (min over devices)"),
            q(f"min by (lane, instance) ({s('headroom_bytes')})", "headroom"),
            q(f"sum by (lane, instance) ({s('projected_bytes')})", "projected by the ledger"),
            q(f"sum by (lane, instance) ({s('gpu_other_process_bytes')})", "other processes"),
            q(f"max by (lane, instance) ({s('policy_reserve_bytes')})", "reserve (policy)"),
            desc="Headroom is what the next prefill may allocate: free (or the idle budget) minus the "
            "reserve minus the ledger's projections. Below 0 the gate holds every prefill.",
            w=24,
        ),
        "reserve.*",
    )
    engine = limit_line(
        series(
            "Engine queue and running requests",
            "short",
            q(f"max by (lane, instance) ({s('engine_queue_requests')})", "engine queue"),
            q(f"max by (lane, instance) ({s('engine_running_requests')})", "engine running"),
            q(f"sum by (lane, instance) ({s('ledger_requests')})", "ledger (forwarded, prefill not done)"),
            q(f"sum by (lane, instance) ({s('held_requests')})", "held in the sidecar"),
            q(
                f"max by (lane, instance) ({s('policy_engine_queue_max_requests')})",
                "limit: engine_queue.max_requests",
            ),
            desc="SGLang's last report, the sidecar's ledger and hold queue.",
            w=8,
        ),
        "limit.*",
    )
    usage = limit_line(
        series(
            "KV and Mamba usage",
            "percentunit",
            q(f"max by (lane, instance, pool) ({s('engine_token_usage_ratio')})", "{{pool}} usage"),
            q(f"max by (lane, instance, pool) ({s('policy_max_usage_ratio')})", "limit: {{pool}} max_usage"),
            desc="SGLang's pool usage against the policy's kv.max_usage and mamba.max_usage.",
            w=8,
        )
        .min(0)
        .max(1),
        "limit.*",
    )
    pending = limit_line(
        series(
            "Pending prefill tokens",
            "short",
            q(f"max by (lane, instance, source) ({s('pending_prefill_tokens')})", "{{source}}"),
            q(
                f"max by (lane, instance) ({s('policy_pending_prefill_max_tokens')})",
                "limit: pending_prefill.max_tokens",
            ),
            desc="Prefill tokens ahead, as the engine reports them and as the ledger knows them.",
            w=8,
        ),
        "limit.*",
    )
    hold_heat = (
        heatmap.Panel()
        .title("Hold time distribution")
        .description("Arrival to final decision, for every decided request (0 for those decided at once).")
        .datasource(DS)
        .span(12)
        .height(8)
        .with_target(
            q(f"sum by (le) (increase({s('hold_seconds_bucket')}[$__rate_interval]))", "{{le}}").format(
                PromQueryFormat.HEATMAP
            )
        )
    )
    hold_q = series("Hold time quantiles", "s", *quantiles("hold_seconds_bucket"))
    ttfb = series(
        "Upstream time to first byte",
        "s",
        *quantiles("upstream_first_byte_seconds_bucket"),
        desc="Forwarding an admitted request to the engine's first body byte: for a stream, about the "
        "time to first token (prefill plus the wait inside SGLang).",
    )
    ages = limit_line(
        series(
            "Signal ages",
            "s",
            q(f"max by (lane, instance, signal) ({s('signal_age_seconds')})", "{{signal}} age"),
            q(
                f"max by (lane, instance, signal) ({s('policy_signal_max_age_seconds')})",
                "limit: {{signal}} max_age_s",
            ),
            desc="Age of the last good read; above its max_age_s the signal is stale.",
            w=8,
        ),
        "limit.*",
    )
    failures = series(
        "Signal failures in a row",
        "short",
        q(f"max by (lane, instance, signal) ({s('signal_consecutive_failures')})", "{{signal}}"),
        w=8,
    )
    reloads = series(
        "Policy reloads",
        "short",
        q(f"sum by (result) (increase({s('policy_reloads_total')}[$__rate_interval]))", "{{result}}"),
        desc="Reload attempts (SIGHUP or upload) by result.",
        w=8,
    )
    margin = limit_line(
        series(
            "Cost margin: in force and the policy's",
            "short",
            q(f"max by (lane, instance) ({s('cost_margin')})", "in force"),
            q(
                f"max by (lane, instance) ({s('projection_underestimate_worst_ratio')})",
                "worst observed / projected",
            ),
            q(f"max by (lane, instance) ({s('policy_cost_margin')})", "policy: cost.margin"),
            desc="The monitor raises the margin in force above the policy's when a GPU reading shows the "
            "engine holding more than the ledger projected (the under-prediction monitor); a policy load "
            "starts again from the policy's. Apart for long: the lane no longer matches its calibration.",
            w=8,
        ),
        "policy.*",
    )
    findings = series(
        "Under-estimates and guard aborts",
        "short",
        q(
            f"sum by (lane, instance) (increase({s('projection_underestimates_total')}[$__rate_interval]))",
            "under-estimates found",
        ),
        q(
            "sum by (lane, instance) (increase("
            + s("requests_total", 'outcome="prefill_overrun"')
            + "[$__rate_interval]))",
            "prefills aborted by the guard",
        ),
        desc="GPU readings above the projection (alert SidecarProjectionUnderestimated) and admitted "
        "prefills the in-flight guard stopped before their peak (SidecarPrefillOverrun).",
        w=8,
    )
    idle = limit_line(
        series(
            "Idle free memory: measured and the policy's",
            "bytes",
            q(f"max by (lane, instance) ({s('idle_free_bytes')})", "measured (engine idle, this process)"),
            q(f"min by (lane, instance) ({s('gpu_free_bytes')})", "GPU free now (min over devices)"),
            q(f"max by (lane, instance) ({s('policy_idle_free_bytes')})", "policy: vram.idle_free_bytes"),
            desc="The idle budget rests on the lane's idle free memory. Measured below the policy's "
            "figure: the card has less than the policy counts on (a new build, a neighbour): recalibrate.",
            w=8,
        ),
        "policy.*",
    )
    process = series(
        "Sidecar process",
        "bytes",
        q(
            f'max by (lane, instance) (process_resident_memory_bytes{{job="sglang-sidecar", {SEL}}})',
            "resident memory",
        ),
        w=12,
    )
    cpu = series(
        "Sidecar CPU",
        "percentunit",
        q(
            f'max by (lane, instance) (rate(process_cpu_seconds_total{{job="sglang-sidecar", {SEL}}}[$__rate_interval]))',
            "CPU",
        ),
        w=12,
    )

    datasource = d.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
    lane = pick("lane", "Lane", f"label_values({P}build_info, lane)")
    instance = pick("instance", "Instance", f'label_values({P}build_info{{lane=~"$lane"}}, instance)')
    return (
        d.Dashboard("SGLang sidecar")
        .uid(UID)
        .description(
            "Admission gate of SGLang lanes: is it open, what it decides and why, the memory and "
            "engine signals it decides on. Metrics and alerts: " + DOCS
        )
        .tags(["sglang", "sglang-sidecar"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(m.DashboardCursorSync.CROSSHAIR)
        .with_variable(datasource)
        .with_variable(lane)
        .with_variable(instance)
        .with_row(d.Row("Is the gate open?"))
        .with_panel(gate)
        .with_panel(held_now)
        .with_panel(stale)
        .with_panel(reload_ok)
        .with_panel(policy)
        .with_panel(decisions)
        .with_panel(outcomes)
        .with_row(d.Row("Memory"))
        .with_panel(memory)
        .with_row(d.Row("Engine against the policy's limits"))
        .with_panel(engine)
        .with_panel(usage)
        .with_panel(pending)
        .with_row(d.Row("The lane against its calibration"))
        .with_panel(margin)
        .with_panel(findings)
        .with_panel(idle)
        .with_row(d.Row("Waiting"))
        .with_panel(hold_heat)
        .with_panel(hold_q)
        .with_panel(ttfb)
        .with_row(d.Row("Signals, policy and process"))
        .with_panel(ages)
        .with_panel(failures)
        .with_panel(reloads)
        .with_panel(process)
        .with_panel(cpu)
    )


def render() -> str:
    model = json.loads(json.dumps(build().build(), cls=JSONEncoder))
    # Stable panel ids in layout order (the SDK leaves them to Grafana, which would renumber on save).
    for i, panel in enumerate(model["panels"], start=1):
        panel["id"] = i
    return json.dumps(model, indent=2, sort_keys=True) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed JSON instead of writing")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(
                f"{OUT} is not what grafana/dashboard.py builds: run python grafana/dashboard.py",
                file=sys.stderr,
            )
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
