"""deploy/prometheus: the rules, their unit tests and the scrape config, checked by promtool itself."""

from __future__ import annotations

import re

import yaml

from tests.tools import ROOT, run_tool

DIR = ROOT / "deploy" / "prometheus"


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


def test_every_alert_has_a_runbook_and_a_readme_section() -> None:
    readme = (ROOT / "README.md").read_text()
    headings = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", readme, re.M)
    }
    for rule in alert_rules():
        ann = rule["annotations"]
        assert {"summary", "description", "runbook", "runbook_url"} <= set(ann), rule["alert"]
        assert (
            "/admission/state" in ann["runbook"]
            or "/healthz" in ann["runbook"]
            or "targets" in ann["runbook"]
        )
        assert "sglang_sidecar_" in ann["runbook"] or "Metric" in ann["runbook"] or "up" in rule["expr"]
        anchor = ann["runbook_url"].split("#", 1)[1]
        assert ann["runbook_url"].startswith("README.md#") and anchor in headings, (rule["alert"], anchor)
