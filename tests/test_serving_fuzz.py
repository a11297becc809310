"""Fuzz the verification server's HTTP API from its OpenAPI schema (schemathesis, a bounded number of examples).

Valid-by-schema and schema-violating requests (random token ids, session ids, sizes, types) must never cause a
server error, every answer must be documented with the declared content type, schema-violating bodies must be
rejected, and every operation but liveness must refuse requests without the token. Afterwards the server still
serves a generation that is exactly the target's.
"""

import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation import GenerationMode

import moa_hf
from moa_hf.serving import ServerLimits, ServingState, create_app

from factory import make_target

TOKEN = "fuzz-token"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
    ignored_auth,
]


@pytest.fixture(scope="module")
def fuzz_state():
    target = make_target("llama")
    drafter = moa_hf.build_drafter(target, own_embeddings=True).eval()
    limits = ServerLimits(
        max_sessions=8, max_tokens_per_session=64, max_draft_tokens=8, session_ttl_s=30, max_request_bytes=8192,
        admission_wait_s=0,  # full: 429 at once
    )  # fmt: skip
    return ServingState(target, drafter, limits=limits, token=TOKEN)


OPERATIONS = [
    "GET /v1/health",
    "GET /v1/info",
    "GET /v1/tokenizer",
    "GET /v1/drafter",
    "POST /v1/sessions",
    "POST /v1/sessions/{session_id}/verify",
    "DELETE /v1/sessions/{session_id}",
]


@pytest.fixture(scope="module")
def api_schema(fuzz_state):
    app = create_app(fuzz_state, docs=True)  # the API docs are off by default, and behind the token when on
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers={"Authorization": f"Bearer {TOKEN}"})
    rejection = schema.config.checks.negative_data_rejection
    rejection.expected_statuses = [*rejection.expected_statuses, "413"]  # an oversized invalid body: rejected too
    return schema


def test_schema_lists_every_operation(api_schema):
    labels = sorted(op.ok().label for op in api_schema.get_all_operations())
    assert labels == sorted(OPERATIONS)


CASES = [(label, GenerationMode.POSITIVE) for label in OPERATIONS] + [
    (label, GenerationMode.NEGATIVE)
    for label in OPERATIONS
    if label.startswith("POST")  # those with a body
]


@pytest.mark.parametrize(("label", "mode"), CASES, ids=[f"{label}-{mode.value}" for label, mode in CASES])
def test_api_fuzz(api_schema, fuzz_state, label, mode):
    # (schemathesis' own pytest plugin, `schema.parametrize`, does not run under pytest 9: hypothesis directly)
    operation = api_schema.find_operation_by_label(label)
    headers = {"Authorization": f"Bearer {TOKEN}"}

    @settings(
        max_examples=100 if label.startswith("POST") else 20,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        case.call_and_validate(headers=headers, checks=CHECKS)
        assert len(fuzz_state.sessions) <= fuzz_state.limits.max_sessions

    run()


def test_fuzz_live_session(fuzz_state):
    """Verify calls with in-range random fields on a live session: only 200, 409 or 422, and every 200 is
    consistent with the session's length; a rejected call leaves the session as it was."""
    from hypothesis import strategies as st
    from starlette.testclient import TestClient

    from moa_hf.serving.protocol import decode_result

    headers = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(fuzz_state)) as http:
        fuzz_state.sessions.clear()
        first = decode_result(http.post("/v1/sessions", json={"input_ids": [5, 6, 7]}, headers=headers).content)
        state = {"n": first.num_verified, "last": first.next_token}
        sid = first.session_id
        body = st.fixed_dictionaries(
            {
                "num_verified": st.integers(1, 12),
                "last_token": st.integers(0, 127),
                "draft_ids": st.lists(st.integers(0, 127), max_size=10),
            },
            optional={
                "context_from": st.integers(0, 12),
                "context_format": st.sampled_from(["fp16", "int8", "fp32"]),
                "want_context": st.booleans(),
            },
        )

        @settings(
            max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(body=body, aligned=st.booleans())
        def run(body, aligned):
            if aligned:  # half of the calls continue from the session's real state
                body = {**body, "num_verified": state["n"], "last_token": state["last"]}
            r = http.post(f"/v1/sessions/{sid}/verify", json=body, headers=headers)
            assert r.status_code in (200, 409, 422), r.text
            if r.status_code == 200:
                result = decode_result(r.content)
                assert result.num_verified == body["num_verified"] + result.accepted + 1
                assert 0 <= result.accepted <= len(body["draft_ids"]) and 0 <= result.next_token < 128
                state.update(n=result.num_verified, last=result.next_token)

        run()
        session = fuzz_state.sessions[sid]
        assert len(session.verified) == state["n"] and session.cache.get_seq_length() == state["n"] - 1


def test_server_still_exact_after_fuzzing(fuzz_state):
    from starlette.testclient import TestClient

    from moa_hf.serving.protocol import decode_result

    target = fuzz_state.target
    with TestClient(create_app(fuzz_state)) as http:
        fuzz_state.sessions.clear()
        headers = {"Authorization": f"Bearer {TOKEN}"}
        r = http.post("/v1/sessions", json={"input_ids": [5, 6, 7]}, headers=headers)
        assert r.status_code == 200, r.text
        first = decode_result(r.content)
        expected = target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=1, do_sample=False)[0, -1].item()
        assert first.next_token == expected
