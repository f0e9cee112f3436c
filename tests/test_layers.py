"""The package's shape is its architecture: each layer imports only the layers below it, and ``serve``
loads nothing of the emulator or the plotting stack. Read statically (every import statement, wherever
it sits) so that a violation names its file and line; ``serve``'s imports are also checked live."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sidecar"

# What each layer may import of the sidecar besides itself (the packages' __init__ docstrings say the
# same). The top level (cli, app, settings) is the composition root and may import any layer.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "policy": {"core"},
    "signals": {"core"},
    "intake": {"core", "policy"},
    "admission": {"core", "policy", "intake", "signals"},
    "http": {"core", "policy", "intake", "admission", "signals"},
    "ops": {"core", "policy", "intake", "admission", "signals", "http"},
    "calibrate": {"core", "policy", "signals"},
}
TOP = {"__init__", "__main__", "cli", "app", "settings"}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported module, at module level) for every import of ``sidecar``/``sidecar_emulator``."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(n) for n in tree.body}
    found: list[tuple[int, str, bool]] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] in ("sidecar", "sidecar_emulator"):
                found.append((node.lineno, name, id(node) in top_level))
    return found


def _modules() -> list[tuple[str, Path]]:
    return [
        (".".join(p.relative_to(ROOT).with_suffix("").parts), p)
        for p in sorted(PACKAGE.rglob("*.py"))
        if "__pycache__" not in p.parts
    ]


def test_every_module_belongs_to_a_known_layer() -> None:
    unknown = [m for m, _ in _modules() if _layer(m) not in ALLOWED and _layer(m) not in TOP]
    assert unknown == [], f"modules outside the layers of tests/test_layers.py: {unknown}"


def test_each_layer_imports_only_the_layers_below_it() -> None:
    violations = []
    for module, path in _modules():
        layer = _layer(module)
        if layer in TOP:
            continue
        for line, name, _ in _imports(path):
            target = _layer(name)
            if name.startswith("sidecar_emulator"):
                violations.append(f"{path.relative_to(ROOT)}:{line}: imports the emulator ({name})")
            elif name in ("sidecar", "sidecar.__version__"):
                if layer == "core":
                    violations.append(f"{path.relative_to(ROOT)}:{line}: core imports the package")
            elif target != layer and target not in ALLOWED[layer]:
                violations.append(f"{path.relative_to(ROOT)}:{line}: {layer} imports {name}")
    assert violations == [], "\n".join(violations)


def test_the_runtime_package_imports_the_emulator_only_lazily_from_the_cli() -> None:
    eager = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for module, path in _modules()
        for line, name, top in _imports(path)
        if name.startswith("sidecar_emulator") and (top or _layer(module) != "cli")
    ]
    assert eager == [], "\n".join(eager)


SERVE_PROBE = """
import json, sys
from sidecar import cli
parser = cli.build_parser()
args = parser.parse_args(["serve", "--policy", "policies/h200-generic.yaml", "--upstream", "http://127.0.0.1:9"])
import sidecar.app, sidecar.settings, sidecar.ops.logs, sidecar.ops.telemetry, sidecar.signals.gpu
print(json.dumps(sorted(sys.modules)))
"""


def test_serve_loads_neither_the_emulator_nor_plotting() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SERVE_PROBE], capture_output=True, text=True, cwd=ROOT, check=False
    )
    if out.returncode != 0:
        pytest.fail(out.stderr)
    loaded = json.loads(out.stdout)
    assert "sidecar.app" in loaded  # the probe reached the serving code
    foreign = [m for m in loaded if m.split(".")[0] in ("sidecar_emulator", "matplotlib")]
    assert foreign == [], f"serve loaded {foreign}"


# The pydantic policy and the sections the rules are built from stay inside ``sidecar/policy/``: the
# shell reads ``core.Rules`` (``policy/in_force.py: rules_in_force``). ``calibrate`` is exempt: it reads a
# lane's policy to plan its probes and writes a proposed one (a policy tool, not the shell).
POLICY_MODELS = {
    "Policy",
    "Lane",
    "Cost",
    "Vram",
    "Kv",
    "Mamba",
    "EngineQueue",
    "PendingPrefill",
    "SignalPolicy",
    "Engine",
    "Gpu",
    "Hold",
    "Monitor",
    "Guard",
}


def test_nothing_outside_the_policy_package_imports_the_pydantic_policy() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for module, path in _modules()
        if _layer(module) not in ("policy", "calibrate")
        for line, name, _ in _imports(path)
        if name.startswith("sidecar.policy.schema.") and name.rsplit(".", 1)[1] in POLICY_MODELS
    ]
    assert found == [], "\n".join(found)
