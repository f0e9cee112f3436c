"""A light install: `pip install .` is what `serve` needs, plotting is an extra, `make demo` installs no
test tools, and the container image only the runtime."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from tests.conftest import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PLOTTING = {"matplotlib", "plotly", "seaborn", "bokeh", "pillow", "kaleido"}
TEST_TOOLS = {"pytest", "ruff", "hypothesis", "schemathesis", "mutmut", "respx", "openai"}


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_runtime_dependencies_are_only_what_serve_needs() -> None:
    runtime = names(PROJECT["dependencies"])
    assert not runtime & PLOTTING, runtime & PLOTTING
    assert not runtime & TEST_TOOLS, runtime & TEST_TOOLS
    assert "numpy" in runtime  # the hot path's input_ids count (sidecar/intake/idscan.py)
    assert names(PROJECT["optional-dependencies"]["emulator"]) == {"matplotlib"}
    assert "matplotlib" in names(PROJECT["optional-dependencies"]["test"])  # the plot tests


def test_serve_and_check_policy_never_import_a_plotting_library() -> None:
    """What `serve` loads (the composition root and everything it wires) imports no plotting module,
    so a runtime install without the extra runs it."""
    code = (
        "import sys, sidecar.cli, sidecar.app, sidecar.settings, sidecar.calibrate.fit;"
        "sidecar.cli.build_parser();"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'matplotlib', 'PIL'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_make_demo_installs_the_emulator_extra_not_the_test_tools() -> None:
    make = (ROOT / "Makefile").read_text()
    demo_stamp = re.search(r"^demo: (\S+)$", make, re.M)
    assert demo_stamp and demo_stamp.group(1) == "$(DEMO_STAMP)"
    recipe = make.split("$(DEMO_STAMP): pyproject.toml\n", 1)[1].split("\n\n", 1)[0]
    assert "-e '.[emulator]'" in recipe and "[test]" not in recipe
    test_recipe = make.split("$(STAMP): pyproject.toml\n", 1)[1].split("\n\n", 1)[0]
    assert "-e '.[test]'" in test_recipe


def test_the_image_installs_the_runtime_only() -> None:
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    installs = re.findall(r"pip (?:install|wheel)[^\n]*", dockerfile)
    assert installs and not any("[" in line for line in installs), installs


def test_replay_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import importlib.util

    from sidecar_emulator.replay import plot_path_problem

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    problem = plot_path_problem(str(tmp_path / "x.png"))
    assert problem and "pip install 'sglang-sidecar[emulator]'" in problem
