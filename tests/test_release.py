"""What a newcomer checks first: the version, the licence, the changelog, and --help that tells all."""

from __future__ import annotations

import argparse
import tomllib

import sidecar
from sidecar.cli import build_parser
from sidecar.settings import Settings
from tests.conftest import ROOT
from tests.test_cli import run

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_version_flag_and_dunder_version_are_the_package_version() -> None:
    r = run("--version")
    assert r.returncode == 0
    assert r.stdout.strip() == f"sglang-sidecar {PYPROJECT['version']}"
    assert sidecar.__version__ == PYPROJECT["version"]


def test_license_file_is_the_licence_pyproject_names() -> None:
    assert PYPROJECT["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text[:200] and "Version 2.0, January 2004" in text[:200]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text


def test_changelog_has_an_unreleased_section_and_the_current_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text and f"## [{PYPROJECT['version']}]" in text


def test_every_serve_setting_is_a_flag_with_its_env_var_and_default() -> None:
    out = run("serve", "--help").stdout
    flat = " ".join(out.split())
    for name, field in Settings.model_fields.items():
        flag, env = "--" + name.replace("_", "-"), f"SIDECAR_{name.upper()}"
        assert flag in out and env in flat, name
        if not field.is_required() and field.default is not None:
            assert (
                f"(default {getattr(field.default, 'value', field.default)}" in flat or "(default o" in flat
            )
    for asked in ("--max-connections", "--upstream-read-timeout-s", "--drain-timeout-s"):
        assert asked in out
    assert "--upstream-connect-timeout-s" in out and "SIDECAR_UPSTREAM_CONNECT_TIMEOUT_S" in flat


def test_every_option_of_every_command_shows_its_default() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, p in sub.choices.items():
        text = " ".join(p.format_help().split())
        for action in p._actions:
            if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
                continue
            if action.default is argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            shown = f"{getattr(action.default, 'value', action.default)}"
            assert action.help, f"{command} {action.option_strings[0]} has no help"
            assert f"default: {shown}" in text or f"default {shown}" in text, (command, action.option_strings)
