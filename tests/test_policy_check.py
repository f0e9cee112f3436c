"""check-policy refuses policies that cannot work or are misread, and says what a good one will do."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.core.decide import Situation, decide
from sidecar.core.decision import Reason
from sidecar.core.ledger import LedgerTotals
from sidecar.core.snapshot import Snapshot
from sidecar.policy.in_force import rules_of
from sidecar.policy.schema import PolicyError, load_policy_file, load_policy_text
from sidecar.policy.summary import summarize
from tests.conftest import EMULATOR_POLICIES, POLICIES, ask
from tests.test_cli import run

OLD = EMULATOR_POLICIES / "maxq-qwen3next-old.yaml"


def problems_of(text: str) -> list[str]:
    with pytest.raises(PolicyError) as e:
        load_policy_text(text, "lane.yaml")
    return e.value.problems


def line_of(text: str, needle: str) -> int:
    return next(i for i, t in enumerate(text.splitlines(), 1) if needle in t)


def test_reserve_at_or_above_the_idle_budget_is_refused_at_its_line() -> None:
    text = OLD.read_text().replace("reserve_bytes: 2MiB", "reserve_bytes: 1372MiB")
    [problem] = problems_of(text)
    assert problem.startswith(f"lane.yaml:{line_of(text, 'reserve_bytes: 1372MiB')}: vram.reserve_bytes: ")
    assert "at or above idle_free_bytes" in problem and "unfit_request" in problem


def test_kv_reserve_over_the_pool_and_mamba_reserve_over_the_slots_are_refused() -> None:
    text = OLD.read_text().replace("max_usage: 0.95", "max_usage: 0.95\n  reserve_tokens: 522880")
    text = text.replace("reserve_slots: 2 ", "reserve_slots: 50 ")
    problems = problems_of(text)
    assert any("kv.reserve_tokens" in p and "at or above the KV pool" in p for p in problems)
    assert any(
        p.startswith(f"lane.yaml:{line_of(text, 'reserve_slots: 50')}: mamba.reserve_slots") for p in problems
    )


def test_a_calibrated_ratio_above_the_margin_is_refused_at_its_line() -> None:
    text = OLD.read_text().replace("calibrated_ratio: 1.0", "calibrated_ratio: 1.02")
    [problem] = problems_of(text)
    at = line_of(text, "calibrated_ratio: 1.02")
    assert problem.startswith(f"lane.yaml:{at}: cost.calibrated_ratio: 1.02 is above cost.margin (1)")
    # Equal to the margin (no safety: the shipped policy itself) is a policy, as is none at all.
    load_policy_text(
        OLD.read_text()
        .replace("margin: 1.0\n", "margin: 1.02\n")
        .replace("calibrated_ratio: 1.0", "calibrated_ratio: 1.02")
    )
    load_policy_text(OLD.read_text().replace("calibrated_ratio: 1.0", ""))


def test_duplicate_keys_are_refused_with_both_lines() -> None:
    text = OLD.read_text().replace("  max_requests: 2\n", "  max_requests: 2\n  max_requests: 20\n")
    [problem] = problems_of(text)
    first, second = line_of(text, "max_requests: 2"), line_of(text, "max_requests: 20")
    assert problem.startswith(f"lane.yaml:{second}: engine_queue.max_requests: duplicate key")
    assert f"first on line {first}" in problem


def test_duplicate_top_level_section_is_refused() -> None:
    text = OLD.read_text() + "\nhold: {max_held: 1000, max_wait_s: 5}\n"
    problems = problems_of(text)
    assert any(": hold: duplicate key" in p for p in problems)


@pytest.mark.parametrize("value", ["-128MiB", "-1"])
def test_a_negative_size_names_the_field_and_says_negative(value: str) -> None:
    text = OLD.read_text().replace("reserve_bytes: 2MiB", f"reserve_bytes: {value}")
    [problem] = problems_of(text)
    assert problem.startswith(f"lane.yaml:{line_of(text, 'reserve_bytes: -')}: vram.reserve_bytes: ")
    assert "cannot be negative" in problem


@pytest.mark.parametrize(("value", "hint"), [("128MB", "128MiB"), ("1GB", "1GiB"), ("12kB", "12KiB")])
def test_decimal_units_are_refused_with_the_binary_spelling(value: str, hint: str) -> None:
    text = OLD.read_text().replace("reserve_bytes: 2MiB", f"reserve_bytes: {value}")
    [problem] = problems_of(text)
    assert "vram.reserve_bytes" in problem and "decimal units" in problem
    assert f"write {hint}" in problem and "KiB, MiB, GiB" in problem


def test_binary_units_and_plain_bytes_are_sizes() -> None:
    text = OLD.read_text().replace("reserve_bytes: 2MiB", "reserve_bytes: 134217728")
    assert load_policy_text(text).policy.vram.reserve_bytes == 128 << 20
    text = OLD.read_text().replace("reserve_bytes: 2MiB", "reserve_bytes: 0.125GiB")
    assert load_policy_text(text).policy.vram.reserve_bytes == 128 << 20


# --------------------------------------------------------------------------------------------------
# The summary is the gate's own arithmetic: at the largest prompt it reports, the gate does not call the
# request unfit; one token more, it does.
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    sorted([*POLICIES.glob("*.yaml"), *EMULATOR_POLICIES.glob("*.yaml")]),
    ids=lambda p: ("emulator-" if "sidecar_emulator" in p.parts else "") + p.stem,
)
def test_largest_admissible_prompt_is_where_the_gate_starts_saying_unfit(path: Path) -> None:
    policy = load_policy_file(path).policy
    s = summarize(policy)
    assert s.max_prompt_tokens is not None
    blind = Snapshot()  # no engine report: the gate falls back to the policy's lane, like the summary

    def reason(n: int) -> Reason | None:
        return decide(ask(policy, n), Situation(rules_of(policy), blind, LedgerTotals(), 0.0)).reason

    assert reason(s.max_prompt_tokens) is not Reason.UNFIT_REQUEST
    assert reason(s.max_prompt_tokens + 1) is Reason.UNFIT_REQUEST


def test_outage_policy_summary_in_sre_numbers() -> None:
    s = summarize(load_policy_file(OLD).policy)
    assert (s.max_prompt_tokens, s.limited_by) == (279_297, "transient")
    by = {lim.by: lim.max_prompt_tokens for lim in s.prompt_limits}
    assert by == {"context": 524_287, "transient": 279_297, "kv_pool": 522_880, "mamba_slots": None}
    fits = {p.prompt_tokens: p.fits for p in s.projections}
    assert fits == {65_536: True, 131_072: True, 262_144: True, 500_000: False}
    assert set(s.on_stale) == {"engine", "gpu"} and "held, up to 600 s" in s.on_stale["engine"]


def test_the_summary_says_how_far_a_request_alone_goes() -> None:
    """Priced by its own chunk schedule (core/decide): up to 284,640 on the outage lane, the longest
    whose own peak fits (evidence D19; the schedules: D15); not without the guard."""
    from sidecar.core.cost import project_own

    loaded = load_policy_file(OLD)
    why = {lim.by: lim.why for lim in summarize(loaded.policy).prompt_limits}["transient"]
    assert "alone, priced by its own chunk schedule, up to 284,640 where its last chunk falls best" in why
    rules = rules_of(loaded.policy)
    cap = rules.vram.transient_cap()
    assert cap is not None
    assert (
        project_own(rules.cost, 284_640, 284_640, 8192)
        <= cap
        < project_own(rules.cost, 284_641, 284_641, 8192)
    )
    off = loaded.with_section("guard", enabled=False).policy
    assert "alone" not in {lim.by: lim.why for lim in summarize(off).prompt_limits}["transient"]


def test_check_policy_ends_with_what_the_policy_will_do() -> None:
    r = run("check-policy", str(OLD))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "largest prompt it can ever admit: 279,297 tokens (set by transient)" in out
    for tier in ("64K", "128K", "256K", "500K"):
        assert f"{tier} tokens:" in out
    assert "engine queue <= 2 requests" in out and "pending prefill <= 600,000 tokens" in out
    assert "engine signal: older than 5 s" in out and "gpu signal:" in out
