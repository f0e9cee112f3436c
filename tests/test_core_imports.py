"""The core is pure: importing it loads the standard library and the core's own modules, nothing else
(no pydantic, no tokenizers, no HTTP, not the rest of the sidecar)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
before = set(sys.modules)
import sidecar.core
import sidecar.core.constraints, sidecar.core.cost, sidecar.core.decide, sidecar.core.decision
import sidecar.core.demand, sidecar.core.ledger, sidecar.core.rules, sidecar.core.snapshot
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_core_imports_only_the_standard_library_and_itself() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert "sidecar.core.decide" in loaded  # the probe did import the core
    stdlib = sys.stdlib_module_names
    foreign = [
        m
        for m in loaded
        if m.split(".")[0] not in stdlib
        and m not in ("sidecar", "sidecar.core")
        and not m.startswith("sidecar.core.")
    ]
    assert foreign == [], f"the core imported {foreign}"
