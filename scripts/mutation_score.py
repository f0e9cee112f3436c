"""`make mutation`'s verdict: the score over the core's mutants, and every survivor accounted for.

Reads mutmut's own results (``mutmut export-cicd-stats`` and ``mutmut results``) and MUTATION.md,
which lists each surviving mutant that is equivalent (no test can tell it from the original) with the
reason, and under "Not killed yet" the survivors that are not equivalent (tests owed; they count against
the score). Exit 1 when a survivor is listed nowhere, or when the score - killed over mutants that are
neither equivalent nor untested - is below 90 %.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

THRESHOLD = 0.90
ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    mutmut = str(Path(sys.executable).with_name("mutmut"))
    subprocess.run([mutmut, "export-cicd-stats"], cwd=ROOT, check=True, capture_output=True)
    stats = json.loads((ROOT / "mutants" / "mutmut-cicd-stats.json").read_text())
    out = subprocess.run([mutmut, "results"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    statuses = re.findall(r"^\s*(\S+): (\w[\w ]*)$", out, re.M)
    survivors = sorted(m for m, status in statuses if status == "survived")
    # A targeted run (``mutmut run "sidecar.policy.schema*"``) leaves the others not checked: they are
    # neither killed nor survivors, and the score is over the mutants that ran.
    unchecked = {m for m, status in statuses if status == "not checked"}
    text = (ROOT / "MUTATION.md").read_text()
    head, _, owed = text.partition("## Not killed yet")
    names = re.compile(r"`(sidecar\.[^`]+__mutmut_\d+)`")
    listed, known = set(names.findall(head)), set(names.findall(owed))
    quoted = dict(re.findall(r"^- `(sidecar\.[^`]+__mutmut_\d+)` \(`([^`]+)`\)", head, re.M))
    stale = [m for m in survivors if m in listed and not _describes(mutmut, m, quoted.get(m))]
    unexplained = [m for m in survivors if m not in listed | known]
    equivalent = len([m for m in survivors if m in listed])
    killed = stats["killed"] + stats.get("timeout", 0)
    judged = stats["total"] - len(unchecked) - stats.get("no_tests", 0) - stats.get("skipped", 0) - equivalent
    score = killed / judged if judged else 1.0
    print(
        f"mutants {stats['total']}: killed {stats['killed']}, timed out {stats.get('timeout', 0)}, "
        f"survived {len(survivors)} ({equivalent} listed as equivalent in MUTATION.md), "
        f"untested {stats.get('no_tests', 0)}"
        + (f", not checked {len(unchecked)} (a targeted run)" if unchecked else "")
    )
    print(
        f"score: {killed}/{judged} = {score:.1%} of non-equivalent mutants killed (threshold {THRESHOLD:.0%})"
    )
    for m in unexplained:
        print(f"  survived, not explained in MUTATION.md: {m}  (mutmut show {m})")
    for m in stale:
        print(
            f"  listed as equivalent, but its entry does not quote this mutant's code: {m}  (mutmut show {m})"
        )
    owed_now = [m for m in survivors if m in known and m not in listed]
    if owed_now:
        print(f"  not killed yet (listed as owed in MUTATION.md): {len(owed_now)}")
    gone = sorted((listed | known) - set(survivors) - unchecked)
    if gone:
        print(f"  listed in MUTATION.md but not surviving (killed, or renumbered away): {', '.join(gone)}")
    return 0 if score >= THRESHOLD and not unexplained and not stale else 1


def _changed_code(mutmut: str, name: str) -> str:
    """The mutant's added lines, white space folded."""
    diff = subprocess.run([mutmut, "show", name], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    added = [line[1:] for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return " ".join(" ".join(added).split())


def _describes(mutmut: str, name: str, quote: str | None) -> bool:
    return quote is not None and " ".join(quote.split()) in _changed_code(mutmut, name)


if __name__ == "__main__":
    sys.exit(main())
