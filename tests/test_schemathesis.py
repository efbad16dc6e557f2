"""Schemathesis against a real ``memfuse serve`` (a subprocess on loopback), on SQLite and on
PostgreSQL: requests generated from the server's own ``/openapi.json``, stateless (every
operation, data that fits the schema and data that does not) and stateful (sequences of
operations that feed each other's results, from the links Schemathesis infers).

Every response must: not be a 5xx; have a status, content type, headers and body the document
declares for it; refuse data that does not fit the schema (so the schema states every bound the
server enforces, e.g. 64-bit integers); need authentication where the document says so. One
check is left out: ``positive_data_acceptance`` (data that fits the schema must be accepted),
because the API's content and path rules (secrets, UTF-8, path names, record types, a used
Idempotency-Key) are semantic, answered 422 by design, and not expressible in JSON Schema.

Bounded: a fixed number of examples per operation (``MEMFUSE_SCHEMATHESIS_EXAMPLES``, default
3) and of stateful scenarios, derandomized (the same examples every run: no flakes), so the
module takes about a minute on a quiet machine. Long-polls and streams are switched off in
generated requests (``wait`` and ``stream`` dropped): they would only wait.
"""
from __future__ import annotations

import os
import uuid
from collections import Counter
from contextlib import ExitStack

import pytest

from mountutil import ControlPlane
from pgutil import pg_bindir, pg_cluster, pg_url

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES = int(os.environ.get("MEMFUSE_SCHEMATHESIS_EXAMPLES", "3"))
SCENARIOS, STEPS = 5, 8


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def served(request, tmp_path_factory):
    """(control plane, schema) of a real ``memfuse serve`` on the parametrized database,
    with a workspace ``ws`` (its store, one record) so generated requests meet real data."""
    with ExitStack() as stack:
        db_url = None
        if request.param == "postgresql":
            if pg_url() is not None:
                db_url = pg_url()
            elif pg_bindir() is None:
                pytest.skip("PostgreSQL or psycopg not installed (./scripts/setup --test installs them)")
            else:
                db_url = stack.enter_context(pg_cluster(max_connections=100))
        cp = ControlPlane(tmp_path_factory.mktemp(f"st-{request.param}"), db_url=db_url).start()
        stack.callback(cp.stop)
        cp.setup_workspace("ws", ("ws",))
        schema = schemathesis.openapi.from_url(cp.url + "/openapi.json", timeout=30)
        token = cp.admin_token

        @schema.auth()
        class AdminToken:
            """The admin token, as Schemathesis' auth provider (so its auth checks know it):
            ``Authorization: Bearer``, and ``x-api-key`` on the Anthropic-compatible
            memory-store API (``/v1/memory_stores``), as the anthropic SDK sends it."""

            def get(self, case, ctx):
                return token

            def set(self, case, data, ctx):
                if case.path.startswith("/v1/memory_stores"):
                    case.headers = {**(case.headers or {}), "x-api-key": data}
                else:
                    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}

        @schema.hook
        def map_query(ctx, query):
            if query is not None:  # long-polls and streams would only wait
                query.pop("wait", None)
                query.pop("stream", None)
            return query

        @schema.hook
        def map_headers(ctx, headers):
            if headers is not None:
                for k in list(headers):
                    if k.lower() == "idempotency-key":  # a key used again for another body is 422
                        headers[k] = str(uuid.uuid4())
            return headers

        yield cp, schema
        lines = cp.log.read_text(errors="replace").splitlines()
        errors = [ln for ln in lines if '"level": "error"' in ln or "Traceback" in ln]
        assert not errors, "\n".join(errors[:20])


def _excluded():
    from schemathesis.specs.openapi import checks

    return [checks.positive_data_acceptance]


def test_stateless(served):
    """Every operation, data that fits the schema and data that does not."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation.modes import GenerationMode

    cp, schema = served
    failures: dict[tuple, str] = {}
    statuses: Counter = Counter()
    skipped: list[str] = []
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 25
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            def run(case):
                try:
                    r = case.call_and_validate(timeout=30, excluded_checks=_excluded())
                    statuses[r.status_code // 100] += 1
                except BaseException as e:  # noqa: BLE001 - collected, reported together
                    key = (op.label, mode.value, str(e).split("\n\n")[1][:200] if "\n\n" in str(e) else str(e)[:200])
                    failures.setdefault(key, f"{e}\n{case.as_curl_command()}"[:3000])

            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (an operation without inputs)
                assert mode == GenerationMode.NEGATIVE, op.label
                skipped.append(op.label)
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
    # the data reached the handlers: successes and refusals both
    assert statuses[2] > 10 and statuses[4] > 10, statuses
    assert len(skipped) <= 3, skipped


def test_stateful(served):
    """Sequences of operations (create a store, write a record, read it, move it...) with the
    links Schemathesis infers from the responses."""
    from hypothesis import HealthCheck, Phase, settings

    cp, schema = served
    calls: Counter = Counter()
    excluded = _excluded()

    class Machine(schema.as_state_machine()):
        def get_call_kwargs(self, case):
            return {"timeout": 30}

        def after_call(self, response, case):
            super().after_call(response, case)
            calls[response.status_code // 100] += 1

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            case.validate_response(response, excluded_checks=excluded, transport_kwargs=kwargs or None)

    Machine.run(settings=settings(max_examples=SCENARIOS, stateful_step_count=STEPS, deadline=None, database=None,
                                  derandomize=True, suppress_health_check=list(HealthCheck),
                                  phases=[Phase.explicit, Phase.generate]))
    assert sum(calls.values()) >= SCENARIOS and calls[2] > 0, calls
