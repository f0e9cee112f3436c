"""deploy/kubernetes: every overlay renders, validates offline against current Kubernetes schemas with
`kubernetes-validate --strict`, and says what the README says (native sidecar, probes, Service, GPU,
drain, policy reload)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.policy.schema import load_policy_text
from tests.kustomize import build
from tests.tools import ROOT

K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
# 1.34: resource.k8s.io/v1 (DRA) is GA; the latest release the validator ships.
VERSIONS = ("1.34.0", "1.37.0")
# Custom resources kubernetes-validate has no schema for: validated against their CRD's OpenAPI schema
# by tests/crd/validate.mjs instead (npm @kubernetes-models/prometheus-operator).
NO_K8S_SCHEMA = {"PodMonitor"}
CRD_CHECK = ROOT / "tests" / "crd" / "validate.mjs"


def render(overlay: Path) -> list[dict[str, Any]]:
    """With a kustomize binary when there is one, else tests/kustomize.py."""
    exe = shutil.which("kustomize")
    if exe:
        out = subprocess.run(
            [exe, "build", "--load-restrictor", "LoadRestrictionsNone", str(overlay)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return [d for d in yaml.safe_load_all(out) if d]
    return build(overlay)


def validate(docs: list[dict[str, Any]], tmp: Path, version: str) -> subprocess.CompletedProcess[str]:
    path = tmp / f"rendered-{version}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    exe = Path(sys.executable).with_name("kubernetes-validate")
    return subprocess.run(
        [str(exe), "--strict", "-k", version, str(path)], capture_output=True, text=True, timeout=120
    )


def crd_check(docs: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    node = shutil.which("node")
    assert node and (CRD_CHECK.parent / "node_modules").exists(), "run `make tools` (npm ci in tests/crd)"
    return subprocess.run(
        [node, str(CRD_CHECK)], input=json.dumps(docs), capture_output=True, text=True, timeout=60
    )


def test_the_crd_check_rejects_a_wrong_type() -> None:
    docs = render(OVERLAYS[0])
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    pm["spec"]["podMetricsEndpoints"][0]["interval"] = 15
    r = crd_check(docs)
    assert r.returncode == 1 and "interval must be string" in r.stdout, r.stdout + r.stderr


def pod_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    return dep["spec"]["template"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_renders_and_validates_strictly(overlay: Path, tmp_path: Path) -> None:
    docs = render(overlay)
    for version in VERSIONS:
        r = validate(docs, tmp_path, version)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "ERROR" not in out, out
        unchecked = {
            line.split("kind ")[1].split()[0] for line in out.splitlines() if "Couldn't find schema" in line
        }
        assert unchecked == NO_K8S_SCHEMA, out
    r = crd_check(docs)
    assert r.returncode == 0, r.stdout + r.stderr
    checked = {c.split("/")[0] for c in json.loads(r.stdout)["checked"]}
    assert checked == NO_K8S_SCHEMA, r.stdout
    assert {d["metadata"]["namespace"] for d in docs} == {f"lane-{overlay.name}"}


def test_the_validator_is_strict(tmp_path: Path) -> None:
    docs = render(OVERLAYS[0])
    pod_of(docs)["initContainers"][0]["restartPolicyy"] = "Always"
    r = validate(docs, tmp_path, VERSIONS[-1])
    assert r.returncode != 0 and "restartPolicyy" in r.stdout + r.stderr


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_says_what_the_readme_says(overlay: Path) -> None:
    docs = render(overlay)
    pod = pod_of(docs)
    sidecar, reloader = pod["initContainers"]
    (engine,) = pod["containers"]
    # A native sidecar in front of the engine.
    assert sidecar["restartPolicy"] == "Always" and reloader["restartPolicy"] == "Always"
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    assert env["SIDECAR_UPSTREAM"] == "http://127.0.0.1:30000"
    # Every environment variable and flag it uses is one `serve` has.
    help_text = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in env:
        assert f"[{name}]" in help_text, name
    for arg in sidecar["args"][1:]:
        assert not arg.startswith("--") or arg in help_text, arg
    # Probes: liveness and start-up local, readiness the one that follows the engine and the drain.
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # The Service exposes the sidecar's data port only; the admin port is the pod's, for Prometheus.
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(8001, "http")]
    assert {p["name"]: p["containerPort"] for p in sidecar["ports"]} == {"http": 8001, "admin": 8002}
    assert env["SIDECAR_LISTEN"].endswith(":8001") and env["SIDECAR_ADMIN_LISTEN"].endswith(":8002")
    # Only the monitoring namespace reaches the admin port (and the engine's).
    (netpol,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    open_to_all, monitoring = netpol["spec"]["ingress"]
    assert "from" not in open_to_all and [p["port"] for p in open_to_all["ports"]] == [8001]
    assert {p["port"] for p in monitoring["ports"]} == {8002, 30000}
    # Both containers name the one GPU claim.
    (claim,) = pod["resourceClaims"]
    assert [c["name"] for c in sidecar["resources"]["claims"]] == [claim["name"]]
    assert [c["name"] for c in engine["resources"]["claims"]] == [claim["name"]]
    assert any(
        d["kind"] == "ResourceClaimTemplate" and d["metadata"]["name"] == claim["resourceClaimTemplateName"]
        for d in docs
    )
    # The grace period covers the engine's preStop wait (300 s) and the sidecar's drain.
    drain = float(sidecar["args"][sidecar["args"].index("--drain-timeout-s") + 1])
    assert "time.time() + 300" in engine["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert pod["terminationGracePeriodSeconds"] >= 300 + drain
    # Policy from a ConfigMap whose name does not change (so an update is a reload, not a rollout),
    # the same file as in policies/, and valid.
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert cm["metadata"]["name"] == "sglang-sidecar-policy"
    assert {v["name"]: v.get("configMap", {}).get("name") for v in pod["volumes"]}["policy"] == cm[
        "metadata"
    ]["name"]
    assert cm["data"]["policy.yaml"] == (ROOT / "policies" / f"{overlay.name}.yaml").read_text()
    load_policy_text(cm["data"]["policy.yaml"], f"policies/{overlay.name}.yaml")
    assert (
        pod["shareProcessNamespace"] is True
        and "pkill -HUP -f '[s]glang-sidecar serve'" in reloader["command"][-1]
    )
    # Admin token from a Secret, at the path the sidecar is told.
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    secret = [v for v in pod["volumes"] if "secret" in v]
    assert env["SIDECAR_ADMIN_TOKEN_FILE"].startswith(mounts[secret[0]["name"]] + "/")
    assert env["SIDECAR_POLICY"].startswith(mounts["policy"] + "/")


def test_podmonitor_scrapes_the_ports_and_jobs_the_alerts_expect() -> None:
    """The CRD schema allows unknown fields (the API server prunes them): the fields used are checked here."""
    docs = render(OVERLAYS[0])
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    pod = pod_of(docs)
    ports = {p["name"] for c in pod["initContainers"] + pod["containers"] for p in c.get("ports", [])}
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    jobs = {}
    for ep in pm["spec"]["podMetricsEndpoints"]:
        assert set(ep) <= {"port", "path", "interval", "relabelings"}
        assert ep["port"] in ports
        jobs[ep["port"]] = next(r["replacement"] for r in ep["relabelings"] if r["targetLabel"] == "job")
    # The sidecar's /metrics is on its admin port, not the data port (which answers 404 there).
    assert jobs == {"admin": "sglang-sidecar", "engine": "sglang"}
