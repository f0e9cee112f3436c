"""deploy/prometheus: the rules, their unit tests and the scrape config, checked by promtool itself."""

from __future__ import annotations

import re

import yaml

from tests.test_docs import anchors
from tests.tools import ROOT, run_tool

DIR = ROOT / "deploy" / "prometheus"
RUNBOOK_BASE_TEMPLATE = (
    "{{ with $externalLabels.runbook_base }}{{ . }}{{ else }}https://runbooks.invalid/sglang-sidecar{{ end }}"
)


def alert_rules() -> list[dict]:
    data = yaml.safe_load((DIR / "alerts.yml").read_text())
    return [r for g in data["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_check_rules_and_config() -> None:
    r = run_tool("promtool", "check", "rules", "alerts.yml", cwd=DIR)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    r = run_tool("promtool", "check", "config", "prometheus.yml", cwd=DIR)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_unit_tests_pass() -> None:
    r = run_tool("promtool", "test", "rules", "alerts.test.yml", cwd=DIR)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    tests = yaml.safe_load((DIR / "alerts.test.yml").read_text())["tests"]
    cases: dict[str, set[bool]] = {}
    for t in tests:
        for case in t.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add(bool(case["exp_alerts"]))
    for rule in alert_rules():
        assert cases.get(rule["alert"]) == {True, False}, f"{rule['alert']}: needs a firing and a quiet case"


def test_every_alert_has_a_runbook_an_absolute_url_and_a_section() -> None:
    """runbook_url is absolute (Alertmanager and its receivers cannot resolve a relative link), its base
    is Prometheus's external label `runbook_base` when set, and it lands on a heading of
    docs/operate.md (slugged as GitHub does, tests/test_docs.py)."""
    headings = anchors(ROOT / "docs" / "operate.md")
    for rule in alert_rules():
        ann = rule["annotations"]
        assert {"summary", "description", "runbook", "runbook_url"} <= set(ann), rule["alert"]
        assert (
            "/admission/state" in ann["runbook"]
            or "/healthz" in ann["runbook"]
            or "targets" in ann["runbook"]
        )
        assert "sglang_sidecar_" in ann["runbook"] or "Metric" in ann["runbook"] or "up" in rule["expr"]
        url = ann["runbook_url"]
        assert url.startswith(RUNBOOK_BASE_TEMPLATE), (rule["alert"], url)
        page, _, anchor = url.removeprefix(RUNBOOK_BASE_TEMPLATE).partition("#")
        assert page == "/docs/operate.md" and anchor in headings, (rule["alert"], anchor)


def test_severities_are_what_alertmanager_routes() -> None:
    assert {r["labels"]["severity"] for r in alert_rules()} == {"critical", "warning"}


def test_the_operate_page_lists_each_alerts_severity() -> None:
    page = (ROOT / "docs" / "operate.md").read_text()
    table = {}
    for names, severity in re.findall(r"^\| (Sidecar[^|]+) \| (critical|warning) \|$", page, re.M):
        table.update(dict.fromkeys((n.strip() for n in names.split(",")), severity))
    assert table == {r["alert"]: r["labels"]["severity"] for r in alert_rules()}
