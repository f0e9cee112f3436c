"""The command-line tools that deployment tests run: promtool, prometheus, systemd-analyze, logrotate, chromium.

`make test` puts them in .tools/bin (scripts/tools.sh); a missing tool fails the test that needs it with
the command that installs it, never a skip (a skipped check would pass with the feature broken).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / ".tools" / "bin"


def tool(name: str) -> str:
    path = TOOLS / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run `make tools` (scripts/tools.sh)")
    return found


def run_tool(
    *args: str, cwd: Path | None = None, timeout: float = 60, stdin_text: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a tool; the result carries rc, stdout and stderr for the assertion message."""
    return subprocess.run(
        [tool(args[0]), *args[1:]],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        check=False,
        input=stdin_text,
    )
