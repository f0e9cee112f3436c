"""schemathesis against the sidecar's own OpenAPI (the admin listener): every admin operation, fed
bodies and parameters generated from the schema it publishes, answers without a server error and as
its schema says (status code documented, body matching the declared response schema)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from .harness import FakeEngine, lane

# per operation; bounded so the file stays a few seconds of make test (`make fuzz` sets more)
EXAMPLES = int(os.environ.get("SIDECAR_FUZZ_EXAMPLES", "25"))
# operations whose 503 is a documented answer about the lane's signals
SIGNAL_503_PATHS = {"/readyz"}


def checks_for(path: str) -> list:
    """What every answer must satisfy. /readyz answers a documented 503 whenever a signal is stale (a
    starved test machine can make the lane's GPU file stale): that is its contract, which
    status_code_conformance checks, not a server error."""
    checks = [status_code_conformance, content_type_conformance, response_schema_conformance]
    return checks if path in SIGNAL_503_PATHS else [not_a_server_error, *checks]


def fuzz_operation(op: schemathesis.APIOperation, checks: list) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy())
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(checks=checks, timeout=10)

    check()


def fuzz_operations(schema_url: str) -> list[str]:
    schema = schemathesis.openapi.from_url(schema_url)
    seen: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()
        seen.append(f"{op.method.upper()} {op.path}")
        fuzz_operation(op, checks_for(op.path))
    return seen


async def test_every_admin_operation_holds_to_its_published_schema(tmp_path: Path) -> None:
    async with lane(tmp_path, FakeEngine()) as (url, app, _):
        seen = await asyncio.to_thread(fuzz_operations, f"{url.admin}/admission/openapi.json")
        assert app.admission.ledger.totals.prefill_tokens == 0
    assert {"GET /admission/state", "POST /admission/explain"} <= set(seen), seen
