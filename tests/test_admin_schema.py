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


def fuzz_operations(schema_url: str) -> list[str]:
    schema = schemathesis.openapi.from_url(schema_url)
    seen: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()
        seen.append(f"{op.method.upper()} {op.path}")

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy())
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(
                checks=[
                    not_a_server_error,
                    status_code_conformance,
                    content_type_conformance,
                    response_schema_conformance,
                ],
                timeout=10,
            )

        check()
    return seen


async def test_every_admin_operation_holds_to_its_published_schema(tmp_path: Path) -> None:
    async with lane(tmp_path, FakeEngine()) as (url, app, _):
        seen = await asyncio.to_thread(fuzz_operations, f"{url.admin}/admission/openapi.json")
        assert app.admission.ledger.totals.prefill_tokens == 0
    assert {"GET /admission/state", "POST /admission/explain"} <= set(seen), seen
