"""deploy/kubernetes: every overlay renders with plain kustomize (no flags), validates offline against
current Kubernetes schemas with `kubernetes-validate --strict`, and says what docs/deploy.md says (native
sidecar, probes, Service, GPU, drain, policy reload by the sidecar's own file watch); the monitoring
kustomization's PrometheusRule is deploy/prometheus/alerts.yml."""

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
MONITORING = K8S / "monitoring"
# 1.34: resource.k8s.io/v1 (DRA) is GA; the latest release the validator ships.
VERSIONS = ("1.34.0", "1.37.0")
# Custom resources kubernetes-validate has no schema for: validated against their CRD's OpenAPI schema
# by tests/crd/validate.mjs instead (npm @kubernetes-models/prometheus-operator).
NO_K8S_SCHEMA = {"PodMonitor"}
CRD_CHECK = ROOT / "tests" / "crd" / "validate.mjs"


def kustomize_command() -> list[str] | None:
    """`kubectl kustomize` or `kustomize build`, as an operator would type them: no flags."""
    if exe := shutil.which("kubectl"):
        return [exe, "kustomize"]
    if exe := shutil.which("kustomize"):
        return [exe, "build"]
    return None


def render(overlay: Path) -> list[dict[str, Any]]:
    """With kubectl's or a kustomize binary when there is one, else tests/kustomize.py (which refuses
    files outside the kustomization's directory, as kustomize's default load restrictor does)."""
    command = kustomize_command()
    if command:
        r = subprocess.run([*command, str(overlay)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{' '.join(command)} {overlay.relative_to(ROOT)}: {r.stderr}"
        return [d for d in yaml.safe_load_all(r.stdout) if d]
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
    (sidecar,) = pod["initContainers"]
    (engine,) = pod["containers"]
    # A native sidecar in front of the engine.
    assert sidecar["restartPolicy"] == "Always"
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
    # The sidecar watches the mounted file itself: no reloader, no shared process namespace.
    assert "shareProcessNamespace" not in pod and float(env["SIDECAR_POLICY_WATCH_S"]) > 0
    # Shadow first, as docs/deploy.md says; memory bounded.
    assert env["SIDECAR_MODE"] == "shadow" and sidecar["resources"]["limits"]["memory"]
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


def test_the_overlays_policy_is_the_shipped_one() -> None:
    """Each overlay carries its policy inside its directory (so it builds without flags): the copy is
    the file in policies/, byte for byte."""
    for overlay in OVERLAYS:
        copy = (overlay / "policy.yaml").read_text()
        assert copy == (ROOT / "policies" / f"{overlay.name}.yaml").read_text(), (
            f"cp policies/{overlay.name}.yaml {overlay.relative_to(ROOT)}/policy.yaml"
        )


def test_the_fallback_renderer_refuses_files_outside_the_kustomization(tmp_path: Path) -> None:
    """tests/kustomize.py stands in for kustomize where neither binary is installed: it refuses what
    kustomize's default load restrictor refuses, so a file outside the overlay cannot pass here."""
    (tmp_path / "outside.yaml").write_text("name: x\n")
    d = tmp_path / "overlay"
    d.mkdir()
    (d / "kustomization.yaml").write_text(
        "configMapGenerator:\n  - name: p\n    files: [policy.yaml=../outside.yaml]\n"
        "generatorOptions: {disableNameSuffixHash: true}\n"
    )
    with pytest.raises(ValueError, match="outside"):
        build(d)


@pytest.mark.skipif(kustomize_command() is None, reason="neither kubectl nor kustomize installed")
def test_the_monitoring_kustomization_is_the_alert_rules(tmp_path: Path) -> None:
    """One PrometheusRule, valid against the Prometheus Operator's CRD, holding exactly the rules
    promtool checks in deploy/prometheus/alerts.yml (scripts/prometheusrule.py writes it)."""
    docs = render(MONITORING)
    (rule,) = docs
    assert rule["kind"] == "PrometheusRule" and rule["apiVersion"] == "monitoring.coreos.com/v1"
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"], "run `python scripts/prometheusrule.py`"
    r = crd_check(docs)
    assert r.returncode == 0 and json.loads(r.stdout)["checked"] == ["PrometheusRule/sglang-sidecar"], (
        r.stdout
    )
    # A wrong type is caught (the check is looking).
    rule["spec"]["groups"][0]["rules"][0]["for"] = 120
    assert crd_check(docs).returncode == 1


# The SGLang release the deploy files pin: --sleep-on-idle and SGLANG_EMPTY_CACHE_INTERVAL were read in
# it (docs/evidence.md RF1, RF2). Another image means reading that release again.
SGLANG_IMAGE = "lmsysorg/sglang:v0.5.4"


def evidence_row(rid: str) -> str:
    text = (ROOT / "docs" / "evidence.md").read_text()
    (row,) = [line for line in text.splitlines() if line.startswith(f'| <a id="{rid}"></a>{rid} |')]
    return row


def test_the_pinned_sglang_release_is_the_one_the_evidence_was_read_in() -> None:
    tag = SGLANG_IMAGE.rsplit(":v", 1)[1]
    section = (ROOT / "docs" / "evidence.md").read_text().split("(RF)")[1]
    assert f"`{SGLANG_IMAGE}`" in section and f"sglang-{tag}-py3-none-any.whl" in section
    assert "`--sleep-on-idle`" in evidence_row("RF1") and "SGLANG_EMPTY_CACHE_INTERVAL" in evidence_row("RF2")
    assert SGLANG_IMAGE in (K8S / "base" / "deployment.yaml").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_the_engine_empties_its_allocator_cache_while_idle(overlay: Path) -> None:
    """calibrate reads each probe's last chunk over an emptied cache (docs/calibrate.md): SGLang empties
    it while idle only with both settings (evidence RF1, RF2). An overlay's args replace the base's, so
    each lane must keep the flag."""
    (engine,) = pod_of(render(overlay))["containers"]
    assert engine["image"] == SGLANG_IMAGE
    assert "--sleep-on-idle" in engine["args"]
    env = {e["name"]: e["value"] for e in engine["env"]}
    assert float(env["SGLANG_EMPTY_CACHE_INTERVAL"]) > 0
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
