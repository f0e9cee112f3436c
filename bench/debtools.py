"""Find a command-line tool, or extract it from Debian's package into ``.tools/`` without installing.

The benchmarks measure against Debian's own builds (nginx 1.22, wrk 4.1 on bookworm). A tool on the
PATH is used as it is; otherwise ``apt-get download`` fetches the packages named (no root needed, no
system change) and ``dpkg -x`` unpacks them under ``.tools/root``; the tool then runs with that tree's
libraries on ``LD_LIBRARY_PATH``. Same layout as ``scripts/tools.sh`` (``.tools/deb``, ``.tools/root``),
which does this for the deployment tests' tools. A machine without a registry (the lent GPU machine)
gets the tree copied in and passed as ``tools_dir``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / ".tools"

# tool -> Debian packages it needs beyond a base system (bookworm names)
PACKAGES = {
    "nginx": ["nginx", "nginx-common"],
    "wrk": ["wrk", "libluajit-5.1-2", "libluajit-5.1-common"],
}


class ToolMissing(RuntimeError):
    """The tool is neither installed nor obtainable from the package archive."""


def _extracted(tree: Path, name: str) -> Path | None:
    for sub in ("usr/sbin", "usr/bin"):
        if (tree / sub / name).is_file():
            return tree / sub / name
    return None


def tool_env(tree: Path) -> dict[str, str]:
    """Environment additions that let a binary extracted under ``tree`` find the libraries beside it."""
    libs = [str(p) for p in sorted((tree / "usr" / "lib").glob("*-linux-gnu"))]
    if not libs:
        return {}
    old = os.environ.get("LD_LIBRARY_PATH")
    return {"LD_LIBRARY_PATH": ":".join(libs + ([old] if old else []))}


def ensure(name: str, tools_dir: Path = TOOLS) -> tuple[str, dict[str, str]]:
    """The path of ``name`` and the environment it needs; extracts Debian's package when missing."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")
    if found:
        return found, {}
    tree = tools_dir / "root"
    binary = _extracted(tree, name)
    if binary is None:
        debs = tools_dir / "deb"
        debs.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run(
                ["apt-get", "download", *PACKAGES[name]], cwd=debs, check=True, capture_output=True, text=True
            )
        except (OSError, subprocess.CalledProcessError) as exc:
            err = getattr(exc, "stderr", "") or exc
            raise ToolMissing(
                f"{name} is not installed and `apt-get download {' '.join(PACKAGES[name])}` failed: {err}"
            ) from exc
        for pkg in PACKAGES[name]:
            for deb in sorted(debs.glob(f"{pkg}_*.deb")):
                subprocess.run(["dpkg", "-x", str(deb), str(tree)], check=True)
        binary = _extracted(tree, name)
        if binary is None:
            raise ToolMissing(f"{name}: the packages {PACKAGES[name]} held no usr/sbin or usr/bin/{name}")
    return str(binary), tool_env(tree)
