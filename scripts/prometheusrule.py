"""Writes deploy/kubernetes/monitoring/prometheusrule.yaml: deploy/prometheus/alerts.yml as a Prometheus
Operator ``PrometheusRule``, so one file holds the rules (tests/test_deploy_kubernetes.py fails when the
two disagree). Run after editing the alerts: ``python scripts/prometheusrule.py``."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "deploy" / "prometheus" / "alerts.yml"
TARGET = ROOT / "deploy" / "kubernetes" / "monitoring" / "prometheusrule.yaml"
HEADER = """\
# Generated from deploy/prometheus/alerts.yml by scripts/prometheusrule.py: edit that file, then run
# `python scripts/prometheusrule.py`. One object for every lane of the cluster (the rules match every
# sidecar by job="sglang-sidecar"): apply it once, with `kubectl apply -k deploy/kubernetes/monitoring`.
# Your Prometheus selects rules by label (its ruleSelector): add that label in the kustomization.
"""


def rule() -> dict:
    groups = yaml.safe_load(SOURCE.read_text())["groups"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "sglang-sidecar",
            "labels": {
                "app.kubernetes.io/name": "sglang-sidecar",
                "app.kubernetes.io/part-of": "sglang-sidecar",
            },
        },
        "spec": {"groups": groups},
    }


def render() -> str:
    return HEADER + yaml.safe_dump(rule(), sort_keys=False, width=110, allow_unicode=True)


if __name__ == "__main__":
    TARGET.write_text(render())
    print(f"wrote {TARGET.relative_to(ROOT)}")
