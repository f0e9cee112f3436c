"""The policy schema's own rules (sidecar/policy/schema.py), each at its boundary: what a policy file
may say and what it is refused for, with the field named. `make mutation` runs these against the
schema's mutants."""

from __future__ import annotations

import datetime
import hashlib
from pathlib import Path

import pytest
import yaml

from sidecar.policy.schema import PolicyError
from tests.conftest import small_policy


def small_policy_text() -> str:
    return yaml.safe_dump(yaml.safe_load(small_policy().policy.model_dump_json()))


def refusal(**overrides: object) -> str:
    with pytest.raises(PolicyError) as e:
        small_policy(**overrides)
    return "\n".join(e.value.problems)


def test_retry_after_bounds_may_meet_but_not_cross() -> None:
    assert (
        small_policy(hold__retry_after_min_s=60, hold__retry_after_max_s=60).policy.hold.retry_after_min_s
        == 60
    )
    why = refusal(hold__retry_after_min_s=61, hold__retry_after_max_s=60)
    assert "hold" in why and "retry_after_min_s must not exceed retry_after_max_s" in why


@pytest.mark.parametrize("signal", ["engine", "gpu"])
def test_a_signal_is_polled_faster_than_it_goes_stale(signal: str) -> None:
    assert small_policy(**{f"{signal}__poll_interval_s": 4.9, f"{signal}__max_age_s": 5}).policy
    why = refusal(**{f"{signal}__poll_interval_s": 5, f"{signal}__max_age_s": 5})
    assert signal in why and "poll_interval_s (5.0) must be below max_age_s (5.0)" in why


def problem(**overrides: object) -> str:
    """The one problem of a policy that contradicts itself, without its ``<test>:line: `` prefix."""
    with pytest.raises(PolicyError) as e:
        small_policy(**overrides)
    (only,) = e.value.problems
    return only.split(": ", 1)[1]


def test_format_size_speaks_mib_and_from_ten_gib_up_gib() -> None:
    from sidecar.policy.schema import format_size

    mib, gib = 1 << 20, 1 << 30
    assert format_size(None) == "unknown"
    assert format_size(1234 * mib) == "1,234 MiB"
    assert format_size(1.4 * mib) == "1 MiB"
    assert format_size(10 * gib - 1) == "10,240 MiB"
    assert format_size(10 * gib) == "10.0 GiB"
    assert format_size(-10 * gib) == "-10.0 GiB"
    assert format_size(12_345.25 * gib) == "12,345.2 GiB"


def test_a_calibrated_ratio_may_equal_the_margin_not_exceed_it() -> None:
    assert small_policy(cost__margin=1.2, cost__calibrated_ratio=1.2).policy
    assert problem(cost__margin=1.2, cost__calibrated_ratio=1.25) == (
        "cost.calibrated_ratio: 1.25 is above cost.margin (1.2): the margin would not cover what the "
        "calibration saw (calibrate writes margin = calibrated_ratio x (1 + safety))"
    )


def test_a_reserve_must_stay_below_the_idle_figure() -> None:
    budget = dict(vram__headroom="idle_budget", vram__idle_free_bytes="100MiB")
    assert small_policy(**budget, vram__reserve_bytes=100 * 2**20 - 1).policy
    assert problem(**budget, vram__reserve_bytes="100MiB") == (
        "vram.reserve_bytes: 100 MiB is at or above idle_free_bytes (100 MiB): no transient could ever "
        "fit, every request would be rejected as unfit_request"
    )
    assert small_policy(
        vram__headroom="idle_budget", vram__idle_free_bytes="auto", vram__reserve_bytes="1GiB"
    )


def test_a_zero_transient_cap_is_refused_one_byte_is_not() -> None:
    assert small_policy(vram__max_transient_bytes=1).policy
    assert problem(vram__max_transient_bytes=0) == (
        "vram.max_transient_bytes: 0 bytes: every request would be rejected as unfit_request"
    )


def test_the_kv_reserve_must_stay_below_the_pool() -> None:
    assert small_policy(kv__reserve_tokens=99_999).policy  # the pool is 100,000
    assert problem(kv__reserve_tokens=100_000) == (
        "kv.reserve_tokens: 100,000 tokens is at or above the KV pool (lane.kv_pool_tokens 100,000): every "
        "request would be rejected as unfit_request"
    )
    assert small_policy(lane__kv_pool_tokens=None, kv__reserve_tokens=10**6).policy  # no pool named


def test_the_mamba_reserve_and_one_request_must_fit_the_slots() -> None:
    assert small_policy(lane__mamba_slots=4, mamba={"slots_per_request": 2, "reserve_slots": 2}).policy
    assert problem(lane__mamba_slots=4, mamba={"slots_per_request": 2, "reserve_slots": 3}) == (
        "mamba.reserve_slots: slots_per_request (2) + reserve_slots (3) exceed the pool (lane.mamba_slots "
        "4): every request would be rejected as unfit_request"
    )
    assert small_policy(mamba={"slots_per_request": 2, "reserve_slots": 30}).policy  # no slot count


def test_an_auto_idle_figure_that_is_not_a_size_says_auto_is_allowed() -> None:
    why = refusal(vram__idle_free_bytes="lots")
    assert "vram.idle_free_bytes" in why and "not a size: 'lots'" in why
    assert why.endswith("; or auto, to let the sidecar measure it")
    assert small_policy(vram__idle_free_bytes=" AUTO ").policy.vram.idle_free_auto


def test_a_policy_file_is_named_in_its_problems_and_kept_with_its_hash(tmp_path: Path) -> None:
    from sidecar.policy.schema import load_policy_file

    good = tmp_path / "lane.yaml"
    text = small_policy_text()
    good.write_text(text)
    loaded = load_policy_file(good)
    assert (loaded.path, loaded.sha256) == (str(good), hashlib.sha256(text.encode()).hexdigest())
    assert loaded.policy.name == "test-lane"
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("max_held: 10", "max_held: -1"))
    with pytest.raises(PolicyError) as e:
        load_policy_file(bad)
    assert e.value.problems[0].startswith(f"{bad}:")
    variant = loaded.with_section("hold", max_held=3)
    assert (variant.policy.hold.max_held, variant.sha256, variant.path) == (3, loaded.sha256, loaded.path)


def test_an_answer_per_reason_else_the_transient_one() -> None:
    from sidecar.policy.schema import Answer, Answers

    a = Answers(reasons={"kv_pool": Answer(status=507)})
    assert a.for_reason("kv_pool").status == 507
    assert a.for_reason("queue_full") == a.transient and a.transient.status == 429
    assert a.for_reason("engine_unavailable") == a.unavailable and a.unavailable.status == 503


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "a size must be bytes or a string such as 560MiB, got True"),
        (-1, "a size cannot be negative, got -1"),
        (2.5, "a size in bytes must be a whole number, got 2.5"),
        (float("inf"), "a size in bytes must be a whole number, got inf"),
        ([1], "a size must be bytes or a string such as 560MiB, got a list"),
        (None, "a size must be bytes or a string such as 560MiB, got nothing (an empty value)"),
        ({"MiB": 560}, "a size must be bytes or a string such as 560MiB, got a mapping"),
        # YAML reads `reserve_bytes: 2026-12-06` as a date.
        (
            datetime.date(2026, 12, 6),
            "a size must be bytes or a string such as 560MiB, got a value of another kind",
        ),
        ("-1MiB", "a size cannot be negative, got '-1MiB'"),
        ("lots", "not a size: 'lots' (write plain bytes, or a number with KiB, MiB or GiB)"),
        ("5Kx", "'5Kx': unknown unit 'Kx'; write plain bytes, or KiB, MiB or GiB"),
        ("1.5B", "a size in bytes must be a whole number, got '1.5B'"),
        ("1.5", "a size in bytes must be a whole number, got '1.5'"),
    ],
)
def test_a_size_that_is_not_one_says_why(value: object, message: str) -> None:
    from sidecar.policy.schema import parse_size

    with pytest.raises(ValueError) as e:
        parse_size(value)
    assert str(e.value) == message


def test_sizes_in_bytes_and_binary_units() -> None:
    from sidecar.policy.schema import parse_size

    assert [parse_size(v) for v in (5, 5.0, "5", " 5 B", "1.5KiB", "2MiB", "1GiB")] == [
        5,
        5,
        5,
        5,
        1536,
        2 << 20,
        1 << 30,
    ]
    with pytest.raises(ValueError, match="decimal units"):
        parse_size("5kb")


def test_policy_text_is_named_by_its_source_and_hashed() -> None:
    from sidecar.policy.schema import load_policy_text

    text = small_policy_text()
    loaded = load_policy_text(text)
    assert (loaded.sha256, loaded.path) == (hashlib.sha256(text.encode()).hexdigest(), None)
    with pytest.raises(PolicyError) as e:
        load_policy_text(text.replace("max_held: 10", "max_held: -1"))
    assert e.value.problems[0].startswith("<policy>:")


def test_a_policy_file_that_cannot_be_read_is_a_policy_error(tmp_path: Path) -> None:
    from sidecar.policy.schema import load_policy_file

    missing = tmp_path / "missing.yaml"
    with pytest.raises(PolicyError) as e:  # what check-policy and a reload report as a refused policy
        load_policy_file(missing)
    assert e.value.problems == [f"{missing}: cannot read: No such file or directory"]
