"""The policy schema's own rules (sidecar/policy/schema.py), each at its boundary: what a policy file
may say and what it is refused for, with the field named. `make mutation` runs these against the
schema's mutants."""

from __future__ import annotations

import pytest

from sidecar.policy.schema import PolicyError
from tests.conftest import small_policy


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
