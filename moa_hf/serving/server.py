"""The verification server: hosts the target (and the drafter's LSA) behind FastAPI, one session per generation.

Each session keeps the target's `DynamicCache` of its verified tokens. One call per drafting cycle verifies the
client's drafted tokens with one target forward, crops the cache to the accepted length and returns the accepted
count, the target's next token and the LSA context vectors of the newly verified positions (see `protocol`).

Under load (see docs/serving.md): handlers are async and never run the model; one scheduler thread
(`batching.Scheduler`) verifies the calls of all sessions together, a batch per forward, and feeds long prompts in
chunks between them. New sessions are admitted against `--max-sessions` and a memory budget, waiting in a FIFO
queue (then 429 with Retry-After). Idle sessions are reaped, and `/v1/health` answers from the event loop at all
times. The HTTP guards (the token before the body, slow clients cut off) and uvicorn: `http_server`.
"""

import hmac
import ipaddress
import logging
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from .batching import AdmissionRefused, SchedulerClosed
from .http_server import (  # ServerThread, run_server, ...: re-exported (see __all__)
    HEALTH_PATH,
    BodyLimit,
    ServerThread,
    TimedH11Protocol,
    TokenGate,
    disconnected,
    run_server,
    uvicorn_config,
)
from .protocol import (
    CONTENT_DIGEST_HEADER,
    PROTOCOL_VERSION,
    VerifyResult,
    bounded_request_models,
    content_digest,
    encode_result,
)
from .state import ClientGone, ServerLimits, ServingState

__all__ = [
    "TOKEN_ENV_VAR",
    "ServerLimits",
    "ServerThread",
    "ServingState",
    "TimedH11Protocol",
    "create_app",
    "is_loopback",
    "run_server",
    "uvicorn_config",
]

logger = logging.getLogger(__name__)

TOKEN_ENV_VAR = "MOA_SERVE_TOKEN"
_BINARY = "application/octet-stream"
_ERRORS = {
    code: {"description": text, "content": {"application/json": {"schema": {"type": "object"}}}}
    for code, text in {
        400: "malformed request",
        401: "missing or wrong token",
        404: "unknown session or resource",
        409: "the client's state does not match the session's",
        410: "the session expired",
        413: "request body too large",
        422: "invalid request fields",
        429: "the server is full: retry after Retry-After seconds",
        503: "the server is shutting down: retry after Retry-After seconds",
    }.items()
}
_BLOB = {
    200: {"description": "safetensors blob", "content": {_BINARY: {"schema": {"type": "string", "format": "binary"}}}}
}


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------------------------------
# The application
# ---------------------------------------------------------------------------------------------------------------------
def _blob_response(body: bytes, digest: str | None = None) -> Response:
    return Response(body, media_type=_BINARY, headers={CONTENT_DIGEST_HEADER: digest or content_digest(body)})


async def _answer(result: VerifyResult, fmt: str) -> Response:
    """The safetensors answer of a create/verify call, encoded off the event loop (a long prompt's context is MBs)."""
    body = await run_in_threadpool(encode_result, result, fmt)
    return _blob_response(body)


def create_app(state: ServingState, docs: bool = False) -> FastAPI:
    """The FastAPI application of one `ServingState`. `docs`: serve /docs, /redoc and /openapi.json (behind the
    token, as everything but /v1/health); off by default (`app.openapi()` still gives the schema)."""
    Create, Verify = bounded_request_models(state.vocab_size)  # token ids below the vocabulary size

    @asynccontextmanager
    async def lifespan(app):
        state.set_draining(False)
        state.scheduler.start()  # reaping runs from the start
        yield
        state.set_draining(True)  # (uvicorn's shutdown: new sessions get 503 + Retry-After)

    app = FastAPI(
        title="moa-hf verification server",
        version=str(PROTOCOL_VERSION),
        description="Client-server speculative decoding with a Mixture-of-Attentions drafter.",
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
        lifespan=lifespan,
    )
    app.state.serving = state
    bearer = HTTPBearer(
        auto_error=False, description=f"required when the server has a token (--token-file or ${TOKEN_ENV_VAR})"
    )

    def authorize(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        """(The token gate checked it before the body was read: this declares it in the OpenAPI schema.)"""
        if state.token is None:
            return
        if credentials is None or credentials.scheme.lower() != "bearer":
            raise HTTPException(
                401, "missing token: send `Authorization: Bearer <token>`", headers={"WWW-Authenticate": "Bearer"}
            )
        if not hmac.compare_digest(credentials.credentials.encode(), state.token.encode()):
            raise HTTPException(401, "wrong token", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return JSONResponse(
                {"detail": "malformed JSON body: " + str(errors[0].get("ctx", {}).get("error", ""))}, status_code=400
            )
        parts = []
        for e in errors[:10]:
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{where or 'body'}: {e.get('msg', 'invalid')}")
        return JSONResponse({"detail": "invalid request: " + "; ".join(parts)}, status_code=422)

    @app.exception_handler(AdmissionRefused)
    async def refused(request: Request, exc: AdmissionRefused) -> JSONResponse:
        body = {"detail": exc.detail, "retry_after_s": exc.retry_after_s, "queue_depth": exc.queue_depth}
        return JSONResponse(body, status_code=exc.status, headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(SchedulerClosed)
    async def closing(request: Request, exc: SchedulerClosed) -> JSONResponse:
        return await refused(request, AdmissionRefused(str(exc), 1, state.admission.queue_depth, status=503))

    auth = [Depends(authorize)]

    @app.get(HEALTH_PATH, summary="liveness and load (no token needed; never waits for the model)")
    async def health() -> dict:
        return state.health()

    @app.get("/v1/info", dependencies=auth, responses=_ERRORS, summary="target, drafter fingerprint and limits")
    async def info() -> dict:
        return state.info()

    @app.get("/v1/tokenizer", dependencies=auth, responses=_ERRORS, summary="the target's tokenizer files")
    async def tokenizer() -> dict:
        if state.tokenizer is None:
            raise HTTPException(404, "this server has no tokenizer; load one on the client (--tokenizer)")
        return state.tokenizer_files()

    @app.get(
        "/v1/drafter",
        dependencies=auth,
        response_class=Response,
        responses={**_ERRORS, **_BLOB},
        summary="the drafter (with its own embedding and LM head) as safetensors",
    )
    async def drafter() -> Response:
        return _blob_response(state.drafter_blob(), state._drafter_digest)

    @app.post(
        "/v1/sessions",
        dependencies=auth,
        response_class=Response,
        responses={**_ERRORS, **_BLOB},
        summary="create a session from verified tokens, verifying optional drafts",
    )
    async def create_session(request: Request, req: Create) -> Response:
        try:
            result = await state.create(req, gone=lambda: disconnected(request.receive))
        except ClientGone as err:
            return JSONResponse({"detail": str(err)}, status_code=499)  # nobody reads it
        except (HTTPException, AdmissionRefused, SchedulerClosed):
            raise
        except Exception as err:
            return _model_failure(err)
        return await _answer(result, req.context_format)

    @app.post(
        "/v1/sessions/{session_id}/verify",
        dependencies=auth,
        response_class=Response,
        responses={**_ERRORS, **_BLOB},
        summary="verify drafted tokens (one drafting cycle)",
    )
    async def verify(session_id: str, req: Verify) -> Response:
        try:
            result = await state.verify(session_id, req)
        except (HTTPException, AdmissionRefused, SchedulerClosed):
            raise
        except Exception as err:
            return _model_failure(err)
        return await _answer(result, req.context_format)

    @app.delete(
        "/v1/sessions/{session_id}",
        dependencies=auth,
        status_code=204,
        response_class=Response,
        responses=_ERRORS,
        summary="end a session",
    )
    async def delete_session(session_id: str) -> Response:
        if not state.delete(session_id):
            raise HTTPException(404, f"unknown session {session_id}")
        return Response(status_code=204)

    app.add_middleware(BodyLimit, max_bytes=state.limits.max_request_bytes)
    app.add_middleware(TokenGate, token=state.token)  # outermost: before the body is read
    return app


def _model_failure(err: Exception) -> JSONResponse:
    logger.error("a verification failed: %s: %s", type(err).__name__, err)
    return JSONResponse(
        {"detail": f"the target failed on this call ({type(err).__name__}: {err}); its session was dropped: create "
         "a new one"},
        status_code=500,
    )  # fmt: skip
