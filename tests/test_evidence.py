"""The repository stands alone: every figure is cited from docs/evidence.md, and every citation resolves.

A policy comment that says "(evidence I4)" is only worth something if row I4 exists; a comment that points
at notes outside the repository is worth nothing to someone with a clean clone.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVIDENCE = ROOT / "docs" / "evidence.md"
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".json", ".cfg", ".ini", ""}
SKIP_PARTS = {"__pycache__", "build", "out", "node_modules"}

# Built from pieces so that this file does not match itself.
OUTSIDE = [re.compile(p) for p in ("BRI" + "EF", "res" + "earch/", "sha" + "red/")]
ROW = re.compile(r"^\|\s*(?:<a id=\"([A-Z]{1,2}\d+)\"></a>)?([A-Z]{1,2}\d+)\s*\|", re.M)
ID = r"\b[A-Z]{1,2}\d+(?:-[A-Z]{0,2}\d+)?"
CITATION = re.compile(rf"evidence(?:\.md)?(?:#|,?\s+(?:rows?\s+)?)({ID}(?:(?:\s*,\s*|\s+and\s+){ID})*)", re.I)


def repo_files() -> list[Path]:
    files = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(p.startswith(".") or p in SKIP_PARTS or p.endswith(".egg-info") for p in rel.parts):
            continue
        if path.is_file() and path.suffix in TEXT_SUFFIXES:
            files.append(path)
    return files


def row_ids() -> set[str]:
    text = EVIDENCE.read_text(encoding="utf-8")
    ids = set()
    for anchor, rid in ROW.findall(text):
        assert not anchor or anchor == rid, f"anchor {anchor} on row {rid}"
        assert rid not in ids, f"row id {rid} used twice"
        ids.add(rid)
    return ids


def expand(token: str) -> list[str]:
    """``M1-M3`` -> M1, M2, M3; ``D1-D2`` -> D1, D2; ``RC1-RC3`` -> RC1, RC2, RC3; ``I5`` -> I5."""
    if "-" not in token:
        return [token]
    first, last = token.split("-")
    letter = first.rstrip("0123456789")
    return [f"{letter}{n}" for n in range(int(first[len(letter) :]), int(last.lstrip(letter)) + 1)]


def test_evidence_rows_have_stable_unique_ids() -> None:
    ids = row_ids()
    assert {"I1", "I4", "M1", "D1", "S1", "F1", "N1", "P1"} <= ids


def test_every_citation_names_an_existing_row() -> None:
    ids = row_ids()
    cited: dict[str, list[str]] = {}
    for path in repo_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in CITATION.finditer(text):
            for token in re.findall(ID, match.group(1)):
                for rid in expand(token):
                    cited.setdefault(rid, []).append(str(path.relative_to(ROOT)))
    missing = {rid: where for rid, where in cited.items() if rid not in ids}
    assert not missing, f"cited rows missing from docs/evidence.md: {missing}"
    # The shipped policies rely on the incident figures: the sweep must have reached them.
    assert {"I4", "I5", "M1", "M2"} <= set(cited)


def test_nothing_points_outside_the_repository() -> None:
    offenders = []
    for path in repo_files():
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if any(p.search(line) for p in OUTSIDE):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
