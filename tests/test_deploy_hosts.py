"""deploy/systemd and deploy/docker, checked by systemd-analyze, hadolint and promtool."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.tools import ROOT, run_tool

SYSTEMD = ROOT / "deploy" / "systemd"
DOCKER = ROOT / "deploy" / "docker"
INSTALLED_AT = "/opt/sglang-sidecar/bin/sglang-sidecar"


def unit_here(tmp: Path, text: str | None = None) -> Path:
    """The unit with ExecStart pointing at this checkout's console script (the only change): verify
    checks that the executable exists."""
    text = text or (SYSTEMD / "sglang-sidecar.service").read_text()
    assert INSTALLED_AT in text
    unit = tmp / "sglang-sidecar.service"
    unit.write_text(text.replace(INSTALLED_AT, str(Path(sys.executable).with_name("sglang-sidecar"))))
    return unit


def test_systemd_unit_verifies_clean_and_is_hardened(tmp_path: Path) -> None:
    unit = unit_here(tmp_path)
    r = run_tool("systemd-analyze", "verify", str(unit))
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr
    r = run_tool("systemd-analyze", "security", "--offline=yes", "--threshold=30", str(unit))
    assert r.returncode == 0, r.stdout + r.stderr
    exposure = float(r.stdout.split("Overall exposure level for sglang-sidecar.service:")[1].split()[0])
    assert exposure < 3.0, r.stdout[-2000:]
    text = unit.read_text()
    for line in (
        "ExecReload=/bin/kill -HUP $MAINPID",
        "DynamicUser=yes",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
    ):
        assert line in text, line
    assert "After=network-online.target sglang.service" in text


def test_systemd_verify_reports_a_typo(tmp_path: Path) -> None:
    text = (SYSTEMD / "sglang-sidecar.service").read_text().replace("ProtectSystem=", "ProtectSystm=")
    r = run_tool("systemd-analyze", "verify", str(unit_here(tmp_path, text)))
    assert "ProtectSystm" in r.stdout + r.stderr


def test_env_file_names_only_serve_options() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for line in (SYSTEMD / "sglang-sidecar.env").read_text().splitlines():
        if line and not line.startswith("#"):
            assert f"[{line.split('=')[0]}]" in help_text, line


def test_dockerfile_passes_hadolint_and_runs_as_non_root() -> None:
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    r = subprocess.run([exe, str(DOCKER / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr
    text = (DOCKER / "Dockerfile").read_text()
    assert "USER 10001" in text and "EXPOSE 8001 8002" in text


def test_compose_wires_the_lane_with_the_repositorys_files(tmp_path: Path) -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"sglang", "sidecar", "prometheus", "grafana"}
    assert "ports" not in services["sglang"]  # the engine is reached through the sidecar only
    assert services["sidecar"]["environment"]["SIDECAR_UPSTREAM"] == "http://sglang:30000"
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            src = vol.replace("${POLICY:-h200-generic}", "h200-generic").split(":")[0]
            if src.startswith("."):
                path = (DOCKER / src).resolve()
                assert path.exists(), (name, vol)
    assert (ROOT / services["sidecar"]["build"]["dockerfile"]).exists()
    # The compose Prometheus config is valid with the shipped rules beside it, and scrapes the jobs
    # the alerts and the dashboard expect.
    shutil.copy(DOCKER / "prometheus.yml", tmp_path / "prometheus.yml")
    shutil.copy(ROOT / "deploy" / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    r = run_tool("promtool", "check", "config", "prometheus.yml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    jobs = lambda p: {j["job_name"] for j in yaml.safe_load(p.read_text())["scrape_configs"]}  # noqa: E731
    assert jobs(DOCKER / "prometheus.yml") == jobs(ROOT / "deploy" / "prometheus" / "prometheus.yml")


def test_compose_engine_empties_its_allocator_cache_while_idle() -> None:
    """As the Kubernetes overlays (tests/test_deploy_kubernetes.py, evidence RF1, RF2)."""
    engine = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["sglang"]
    assert engine["image"] == "lmsysorg/sglang:v0.5.4"
    assert "--sleep-on-idle" in engine["command"].split()
    assert float(engine["environment"]["SGLANG_EMPTY_CACHE_INTERVAL"]) > 0


def test_descriptor_limits_cover_the_connection_limits() -> None:
    """Each client connection and each pooled upstream one is a descriptor: the unit's and the compose
    service's open-file limits stay above the sidecar's own connection caps (one line each)."""
    from sidecar.settings import Settings

    caps = {n: f.default for n, f in Settings.model_fields.items()}
    needed = caps["max_client_connections"] + caps["max_connections"]
    (line,) = [
        x
        for x in (SYSTEMD / "sglang-sidecar.service").read_text().splitlines()
        if x.startswith("LimitNOFILE=")
    ]
    assert int(line.split("=")[1]) > needed
    sidecar = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["sidecar"]
    assert sidecar["ulimits"]["nofile"]["soft"] > needed and sidecar["mem_limit"]
