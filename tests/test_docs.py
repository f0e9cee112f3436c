"""The README stays short and every link in it and in docs/ lands: the file exists and the anchor is a
heading of it, slugged as GitHub does. A section moved or renamed without its links fails here."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import ROOT

README = ROOT / "README.md"
PAGES = [README, ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but `-` and `_` removed,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in re.findall(r"^#{1,6} (.+?)\s*#*$", FENCE.sub("", page.read_text(encoding="utf-8")), re.M):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return frozenset(out)


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8")))


def test_slug_is_githubs() -> None:
    assert slug("`vram.idle_free_bytes: auto`") == "vramidle_free_bytes-auto"
    assert slug("Behind a router (many lanes)") == "behind-a-router-many-lanes"
    assert slug("Qualify a lane with `calibrate`") == "qualify-a-lane-with-calibrate"


def test_readme_fits_a_few_screens() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md is {lines} lines: move reference text to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(
                f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}"
            )
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_readme_links_every_docs_page() -> None:
    """Every page under docs/ is one click from the README."""
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README) if t.startswith("docs/")}
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert not missing, f"README.md links no {missing}"


def test_a_broken_anchor_is_caught(tmp_path: Path) -> None:
    """The check is really looking: a link to a heading that is not there is reported."""
    page = tmp_path / "a.md"
    page.write_text("# Title\n\n## Real one\n\n[x](#real-one) [y](#gone)\n")
    found = [t for t in links(page) if t.lstrip("#") not in anchors(page)]
    assert found == ["#gone"]


def test_the_policy_reference_names_every_field() -> None:
    """docs/policies.md's table has a row for every field of the schema (a new field without one fails)."""
    from sidecar.policy.schema import Policy
    from sidecar.policy.wording import model_at

    page = (ROOT / "docs" / "policies.md").read_text(encoding="utf-8")
    rows = " ".join(re.findall(r"^\| (.+?) \|", page, re.M))
    named = set(re.findall(r"`([a-z_.]+)`", rows))

    def fields(model: type, prefix: str = "") -> list[str]:
        out = []
        for name in model.model_fields:
            path = prefix + name
            out.append(path)
            sub = model_at(model, (name,))
            if sub is not None and name != "answers":  # answers' entries are one shape, described once
                out += fields(sub, path + ".")
        return out

    missing = [f for f in fields(Policy) if f not in named]
    assert not missing, f"docs/policies.md's reference lacks {missing}"
