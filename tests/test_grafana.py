"""grafana/: the dashboard is what its source builds, uses only variables for its datasource, and
answers the questions it is for; the provisioning files have the shape Grafana reads."""

from __future__ import annotations

import importlib.util
import json
import re

import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard

from tests.tools import ROOT

GRAFANA = ROOT / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "sglang-sidecar.json"


def source():
    spec = importlib.util.spec_from_file_location("grafana_dashboard", GRAFANA / "dashboard.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_json_is_what_the_source_builds() -> None:
    assert DASHBOARD.read_text() == source().render(), "run: python grafana/dashboard.py"


def _walk(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield path + "/" + k, k, v
            yield from _walk(v, path + "/" + k)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def test_stable_uid_variables_and_no_hard_coded_datasource() -> None:
    model = json.loads(DASHBOARD.read_text())
    assert model["uid"] == "sglang-sidecar" and model["schemaVersion"] >= 39
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert {"lane", "instance"} <= set(variables)
    for path, key, value in _walk(model):
        if key == "datasource" and isinstance(value, dict):
            assert value == {"type": "prometheus", "uid": "${datasource}"}, path
    panels = model["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        if p["type"] == "row":
            continue
        assert p.get("targets"), p["title"]
        if p["type"] == "timeseries":
            assert p["fieldConfig"]["defaults"].get("unit"), f"{p['title']}: no unit"
        for t in p["targets"]:
            assert 'lane=~"$lane"' in t["expr"] and 'instance=~"$instance"' in t["expr"], (
                p["title"],
                t["expr"],
            )


def test_the_dashboard_answers_the_questions_it_is_for() -> None:
    """Each question of the issue maps to a panel that reads the metric answering it."""
    model = json.loads(DASHBOARD.read_text())
    exprs = {p["title"]: " ".join(t["expr"] for t in p.get("targets", [])) for p in model["panels"]}
    wanted = {
        "Gate open": ["gate_open"],
        "Decisions per second": ["decisions_total", "held_total"],
        "GPU memory: free, headroom, projected, reserve": [
            "headroom_bytes",
            "projected_bytes",
            "gpu_free_bytes",
            "policy_reserve_bytes",
        ],
        "Engine queue and running requests": [
            "engine_queue_requests",
            "engine_running_requests",
            "policy_engine_queue_max_requests",
        ],
        "KV and Mamba usage": ["engine_token_usage_ratio", "policy_max_usage_ratio"],
        "Pending prefill tokens": ["pending_prefill_tokens", "policy_pending_prefill_max_tokens"],
        "Hold time distribution": ["hold_seconds_bucket"],
        "Signal ages": ["signal_age_seconds", "policy_signal_max_age_seconds"],
        "Signal age / max age": ["signal_age_seconds"],
        "Upstream time to first byte": ["upstream_first_byte_seconds_bucket"],
        "Policy in force": ["policy_info"],
        "Policy reloads": ["policy_reloads_total"],
        # The lane against its calibration: the monitor's margin, what it found, the idle figure.
        "Cost margin: in force and the policy's": [
            "cost_margin",
            "policy_cost_margin",
            "projection_underestimate_worst_ratio",
        ],
        "Under-estimates and guard aborts": ["projection_underestimates_total", "requests_total"],
        "Idle free memory: measured and the policy's": ["idle_free_bytes", "policy_idle_free_bytes"],
    }
    for title, metrics in wanted.items():
        assert title in exprs, title
        for metric in metrics:
            assert re.search(rf"\bsglang_sidecar_{metric}\b", exprs[title]), (title, metric)


def test_provisioning_files_have_grafanas_shape() -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert ds["apiVersion"] == 1
    (prom,) = ds["datasources"]
    assert prom["type"] == "prometheus" and prom["access"] == "proxy" and prom["url"].startswith("http")
    dash = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "sglang-sidecar.yaml").read_text())
    assert dash["apiVersion"] == 1
    (provider,) = dash["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    # The compose file mounts the dashboards where the provider looks.
    compose = (ROOT / "deploy" / "docker" / "compose.yaml").read_text()
    assert provider["options"]["path"] in compose


def _lost(ours, decoded, path=""):
    """What of ``ours`` did not come back from Grafana's types: keys dropped or values changed."""
    if isinstance(ours, dict):
        if not isinstance(decoded, dict):
            return [path]
        return [
            p
            for k, v in ours.items()
            for p in (_lost(v, decoded[k], f"{path}/{k}") if k in decoded else [f"{path}/{k}"])
        ]
    if isinstance(ours, list):
        if not isinstance(decoded, list) or len(ours) != len(decoded):
            return [path]
        return [
            p for i, (a, b) in enumerate(zip(ours, decoded, strict=True)) for p in _lost(a, b, f"{path}[{i}]")
        ]
    return [] if ours == decoded else [path]


def test_grafanas_own_types_read_the_committed_json_back() -> None:
    """Decoded with grafana-foundation-sdk's dashboard model (panels and queries by plugin), nothing is
    dropped or changed: the JSON is a dashboard as Grafana's schema describes it."""
    register_default_plugins()
    ours = json.loads(DASHBOARD.read_text())
    decoded = json.loads(json.dumps(Dashboard.from_json(ours), cls=JSONEncoder))
    assert _lost(ours, decoded) == []
