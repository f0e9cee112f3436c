"""Messages a person can act on: a broken policy is reported in the file's terms (the field, what it
expects, what it holds), a typo with the name it was meant to be, and never in pydantic's own words."""

from __future__ import annotations

import re

import pytest

from sidecar.policy.schema import PolicyError, load_policy_text
from tests.conftest import ROOT

SHIPPED = (ROOT / "policies" / "h200-generic.yaml").read_text()
LIBRARY_WORDS = ("instance of", "Value error", "NoneType", "Input should", "Extra inputs", "Field required")


def problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as e:
        load_policy_text(text, "lane.yaml")
    return [p.split(": ", 1)[1] for p in e.value.problems]  # without "lane.yaml:N"


def section_to(text: str, section: str, value: str) -> str:
    return re.sub(rf"(?m)^{section}:\n(?:  .*\n)+", f"{section}: {value}\n", text, count=1)


CASES = [
    # (the file, what the person reads)
    (
        SHIPPED.replace("  margin:", "  margn:", 1),
        ["cost.margn: unknown field in cost; did you mean 'margin'?"],
    ),
    (
        SHIPPED.replace("  max_held:", "  max_hold:", 1),
        ["hold.max_hold: unknown field in hold; did you mean 'max_held'?"],  # not also "max_held missing"
    ),
    (SHIPPED + "guardd: {enabled: true}\n", ["guardd: unknown section; did you mean 'guard'?"]),
    (
        section_to(SHIPPED, "engine_queue", "null"),
        [
            "engine_queue: expected a section with the fields max_requests, on_exceed; got nothing (an empty value)"
        ],
    ),
    (
        section_to(SHIPPED, "engine_queue", "4"),
        ["engine_queue: expected a section with the fields max_requests, on_exceed; got the number 4"],
    ),
    (SHIPPED + "guard: {enabled: maybe}\n", ["guard.enabled: expected true or false, got the text 'maybe'"]),
    (
        SHIPPED.replace("  reserve_bytes:", "  reserve_bytes: null #", 1),
        ["vram.reserve_bytes: a size must be bytes or a string such as 560MiB, got nothing (an empty value)"],
    ),
    (
        SHIPPED + "answers: {reasons: {queue_ful: {status: 503}}}\n",
        ["answers.reasons.queue_ful: unknown key; did you mean 'queue_full'?"],
    ),
    (
        SHIPPED + "answers: {transient: {status: 200}}\n",
        ["answers.transient.status: must be at least 400, got 200"],
    ),
    (SHIPPED + "gated_paths: /generate\n", ["gated_paths: expected a list, got the text '/generate'"]),
    (
        "name: x\n",
        [
            f"{s}: required section missing"
            for s in ("lane", "cost", "engine_queue", "pending_prefill", "engine", "gpu", "hold")
        ],
    ),
]


@pytest.mark.parametrize(("text", "said"), CASES, ids=[c[1][0].split(":")[0] for c in CASES])
def test_a_broken_policy_reads_as_its_writer_would_say_it(text: str, said: list[str]) -> None:
    got = problems(text)
    assert got == said
    assert not [p for p in got for w in LIBRARY_WORDS if w in p], got


def test_no_suggestion_when_nothing_is_close() -> None:
    (said,) = problems(SHIPPED + "zzz: 1\n")
    assert said.startswith("zzz: unknown section; known: name, description") and "did you mean" not in said
    (said,) = problems(SHIPPED.replace("on_stale: hold", "on_stale: wait", 1))
    assert said == "engine.on_stale: expected 'admit', 'hold' or 'reject', got the text 'wait'"
