"""The verification server: hosts the target (and the drafter's LSA) behind FastAPI, one session per generation.

Each session keeps the target's `DynamicCache` of its verified tokens. One call per drafting cycle verifies the
client's drafted tokens with one target forward, crops the cache to the accepted length and returns the accepted
count, the target's next token and the LSA context vectors of the newly verified positions (see `protocol`).
"""

import base64
import copy
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import tempfile
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import torch
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import Field, create_model
from transformers import DynamicCache

from ..modeling import oldest_held_position, target_fingerprint
from ..speculative import sampling_warpers, verify
from . import protocol
from .protocol import (
    CONTEXT_FORMATS,
    PROTOCOL_VERSION,
    CreateSessionRequest,
    SparseDistribution,
    VerifyRequest,
    VerifyResult,
    download_digests,
    download_revision,
    encode_drafter,
    encode_result,
    lsa_fingerprint,
    tokenizer_file_bytes,
)

__all__ = ["ServerLimits", "ServingState", "ServerThread", "create_app", "is_loopback", "TOKEN_ENV_VAR"]

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
        429: "too many sessions",
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


@dataclass
class ServerLimits:
    """Configurable limits (see `moa serve --help`)."""

    max_sessions: int = 16
    max_tokens_per_session: int = 4096
    max_draft_tokens: int = 64
    session_ttl_s: float = 300.0
    max_request_bytes: int = 1 << 20


@dataclass
class _Session:
    id: str
    verified: list[int]  # every verified token; the cache holds keys/values of verified[:cache length]
    cache: DynamicCache
    request: CreateSessionRequest
    generator: torch.Generator | None
    last_used: float = field(default_factory=time.monotonic)


class ServingState:
    """The models, limits and live sessions of one server. All model work runs under one lock."""

    def __init__(
        self,
        target,
        drafter,
        tokenizer=None,
        limits: ServerLimits | None = None,
        token: str | None = None,
        allow_other_target: bool = False,
    ):
        if drafter.config.target_layer_inference > 0:
            raise ValueError(
                "Client-server drafting needs a drafter with target_layer_inference=0 (the client cannot run the "
                f"target's last layers); this one has {drafter.config.target_layer_inference}."
            )
        drafter.check_target(target, allow_other_target=allow_other_target)  # by weights (`target_fingerprint`)
        self.target = target.eval()
        if drafter.dtype != target.dtype or drafter.device != target.device:  # a copy: leave the caller's as it is
            drafter = copy.deepcopy(drafter).to(device=target.device, dtype=target.dtype)
        self.drafter = drafter.eval()
        self.tokenizer = tokenizer
        self.limits = limits or ServerLimits()
        self.token = token
        self.vocab_size = int(target.get_output_embeddings().weight.shape[0])
        self.device = target.device
        self.fingerprint = lsa_fingerprint(self.drafter)
        self.target_fingerprint = target_fingerprint(self.target)
        self.sessions: OrderedDict[str, _Session] = OrderedDict()
        self.expired: deque[str] = deque(maxlen=1024)
        self.lock = threading.Lock()
        # What a client downloads, built once: its revision tells a client whether its cached copy is current.
        self._drafter_blob = encode_drafter(self.drafter, self.target)
        self._tokenizer_files = _saved_tokenizer_files(tokenizer) if tokenizer is not None else None
        files = tokenizer_file_bytes(self._tokenizer_files) if tokenizer is not None else None
        self.revision = download_revision(download_digests(self._drafter_blob, files))
        eos = target.generation_config.eos_token_id
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])

    # -- helpers --------------------------------------------------------------------------------------------------
    def info(self) -> dict:
        c = self.drafter.config
        return {
            "protocol_version": PROTOCOL_VERSION,
            "target": getattr(self.target.config, "name_or_path", "") or type(self.target).__name__,
            "target_fingerprint": self.target_fingerprint,
            "dtype": str(self.target.dtype).removeprefix("torch."),
            "vocab_size": self.vocab_size,
            "eos_token_ids": self.eos_token_ids,
            "drafter": {
                "lsa_fingerprint": self.fingerprint,
                "revision": self.revision,
                "bytes": len(self._drafter_blob),
                "hidden_size": c.hidden_size,
                "own_embeddings": bool(c.own_embeddings),
            },
            "has_tokenizer": self.tokenizer is not None,
            "context_formats": list(CONTEXT_FORMATS),
            "limits": vars(self.limits).copy(),
        }

    def drafter_blob(self) -> bytes:
        return self._drafter_blob

    def tokenizer_files(self) -> dict[str, dict[str, str]]:
        """The tokenizer's saved files: {"files": {name: text}, "binary_files": {name: base64}}."""
        return self._tokenizer_files

    def _sweep(self, now: float) -> None:
        ttl = self.limits.session_ttl_s
        for sid in [sid for sid, s in self.sessions.items() if now - s.last_used > ttl]:
            del self.sessions[sid]
            self.expired.append(sid)

    def _check_ids(self, name: str, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise HTTPException(422, f"{name} holds token ids outside [0, {self.vocab_size}): {bad[:5]}")

    def _check_drafts(self, req, total_after: int) -> None:
        limits = self.limits
        if len(req.draft_ids) > limits.max_draft_tokens:
            raise HTTPException(
                422,
                f"{len(req.draft_ids)} drafted tokens exceed this server's limit of {limits.max_draft_tokens} "
                "per call (--max-draft-tokens): send them in several calls",
            )
        self._check_ids("draft_ids", req.draft_ids)
        if total_after > limits.max_tokens_per_session:
            raise HTTPException(
                422,
                f"the session would hold {total_after} tokens, over this server's limit of "
                f"{limits.max_tokens_per_session} (--max-tokens-per-session)",
            )

    def _check_probs(self, drafts: list[int], probs: list[SparseDistribution] | None, do_sample: bool) -> None:
        if not do_sample:
            if probs is not None:
                raise HTTPException(422, "draft_probs are only used with do_sample=true; leave them out")
            return
        if drafts and (probs is None or len(probs) != len(drafts)):
            n = 0 if probs is None else len(probs)
            raise HTTPException(
                422, f"do_sample needs one draft_probs entry per drafted token ({len(drafts)}), got {n}"
            )
        for i, (token, dist) in enumerate(zip(drafts, probs or [])):
            if len(dist.ids) != len(dist.probs):
                raise HTTPException(422, f"draft_probs[{i}]: {len(dist.ids)} ids but {len(dist.probs)} probs")
            self._check_ids(f"draft_probs[{i}].ids", dist.ids)
            if len(set(dist.ids)) != len(dist.ids):
                raise HTTPException(422, f"draft_probs[{i}].ids repeats a token id")
            if any(not 0.0 <= p <= 1.0 for p in dist.probs) or abs(sum(dist.probs) - 1.0) > 1e-3:
                raise HTTPException(422, f"draft_probs[{i}].probs must be in [0, 1] and sum to 1")
            if token not in dist.ids or dist.probs[dist.ids.index(token)] <= 0.0:
                raise HTTPException(422, f"draft_probs[{i}] gives drafted token {token} no probability")

    def _context_range(self, req, default_start: int, num_verified: int) -> int:
        start = default_start if req.context_from is None else req.context_from
        if start > num_verified:
            raise HTTPException(422, f"context_from={start} is past the {num_verified} verified tokens")
        return start

    # -- endpoints --------------------------------------------------------------------------------------------------
    def create(self, req: CreateSessionRequest) -> VerifyResult:
        self._check_ids("input_ids", req.input_ids)
        self._check_drafts(req, len(req.input_ids) + len(req.draft_ids) + 1)
        self._check_probs(req.draft_ids, req.draft_probs, req.do_sample)
        start = self._context_range(req, 0, len(req.input_ids))
        with self.lock:
            now = time.monotonic()
            self._sweep(now)
            if len(self.sessions) >= self.limits.max_sessions:
                raise HTTPException(
                    429,
                    f"this server already runs {len(self.sessions)} sessions (--max-sessions "
                    f"{self.limits.max_sessions}); retry later",
                )
            generator = None
            if req.do_sample:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(req.seed if req.seed is not None else secrets.randbits(63))
            session = _Session(
                id=secrets.token_urlsafe(16),
                verified=list(req.input_ids),
                cache=DynamicCache(config=self.target.config),
                request=req,
                generator=generator,
            )
            # sliding-window layers keep the states a rejected draft needs until `crop` (as assisted generation does)
            session.cache.activate_past_recording()
            result = self._verify(session, req, start)
            self.sessions[session.id] = session
            return result

    def verify(self, session_id: str, req: VerifyRequest) -> VerifyResult:
        self._check_ids("last_token", [req.last_token])
        with self.lock:
            now = time.monotonic()
            self._sweep(now)
            session = self.sessions.get(session_id)
            if session is None:
                if session_id in self.expired:
                    raise HTTPException(
                        410,
                        f"session {session_id} expired (idle over {self.limits.session_ttl_s} s);"
                        " create a new one with the verified prefix",
                    )
                raise HTTPException(404, f"unknown session {session_id}; create one with POST /v1/sessions")
            n = len(session.verified)
            if req.num_verified > n or session.verified[req.num_verified - 1] != req.last_token:
                raise HTTPException(
                    409,
                    f"the client holds {req.num_verified} verified tokens ending in {req.last_token}, the "
                    f"session {n}; create a new session with the client's verified prefix",
                )
            self._check_drafts(req, req.num_verified + len(req.draft_ids) + 1)
            self._check_probs(req.draft_ids, req.draft_probs, session.request.do_sample)
            if req.num_verified < n:  # an answer was lost on the way back: roll back to what the client holds
                del session.verified[req.num_verified :]
                _crop_to(session.cache, req.num_verified - 1)
            start = self._context_range(req, session.cache.get_seq_length(), req.num_verified)
            session.last_used = now
            try:
                return self._verify(session, req, start)
            except Exception:
                del self.sessions[session_id]  # its cache may be half-updated
                raise

    def delete(self, session_id: str) -> bool:
        with self.lock:
            return self.sessions.pop(session_id, None) is not None

    @torch.no_grad()
    def _verify(self, session: _Session, req, context_start: int) -> VerifyResult:
        """One target forward over the uncached verified tokens and the drafts; accept, crop, gather context."""
        t0 = time.perf_counter()
        drafts = list(req.draft_ids)
        k = len(drafts)
        n = len(session.verified)
        cached = session.cache.get_seq_length()
        ids = torch.tensor([session.verified[cached:] + drafts], device=self.device)  # [1, n-cached+k]
        out = self.target(input_ids=ids, past_key_values=session.cache, use_cache=True, logits_to_keep=k + 1)
        logits = out.logits[0, -(k + 1) :].float()  # [k+1, V]: predictions after verified[-1], d_1, ..., d_k
        accepted, next_token = _accept(logits, drafts, req.draft_probs or [], session)
        new_len = n + accepted  # keys/values kept for verified + accepted drafts; next_token has none yet
        _crop_to(session.cache, new_len)
        session.verified.extend(drafts[:accepted] + [next_token])
        context, valid_from = None, 0
        if req.want_context:
            context = self.drafter.read_context(session.cache, min(context_start, new_len), new_len)  # [1, T, d]
            context = context[0].float().cpu()  # [T, d]
            valid_from = oldest_held_position(session.cache)  # older positions were read as zeros
        return VerifyResult(
            session_id=session.id,
            num_verified=len(session.verified),
            accepted=accepted,
            next_token=next_token,
            context_start=context_start,
            server_s=time.perf_counter() - t0,
            context=context,
            context_valid_from=valid_from,
        )


def _saved_tokenizer_files(tokenizer) -> dict[str, dict[str, str]]:
    """The files `tokenizer.save_pretrained` writes: {"files": {name: text}, "binary_files": {name: base64}}."""
    files, binary = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        for path in sorted(Path(tmp).iterdir()):
            if not path.is_file():
                continue
            data = path.read_bytes()
            try:
                files[path.name] = data.decode("utf-8")
            except UnicodeDecodeError:  # e.g. a SentencePiece model
                binary[path.name] = base64.b64encode(data).decode("ascii")
    return {"files": files, "binary_files": binary}


def _crop_to(cache: DynamicCache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _accept(logits: torch.Tensor, drafts: list[int], dists: list[SparseDistribution], session: _Session):
    """(accepted, next token) for the target's logits [k+1, V]: greedy, or speculative sampling with the session's
    temperature, top-k and top-p and the drafter's sparse distributions as q (see `moa_hf.speculative`)."""
    r = session.request
    warpers = sampling_warpers(r.temperature, r.top_k, r.top_p) if r.do_sample else None
    draft_ids = torch.tensor(drafts, dtype=torch.long, device=logits.device)  # [k]
    q = _draft_q(dists, logits.shape[-1], logits.device) if warpers is not None and drafts else None
    return verify(logits, draft_ids, warpers, q, session.generator)


def _draft_q(dists: list[SparseDistribution], vocab_size: int, device) -> torch.Tensor:
    """The drafter's sparse distributions -> q [k, V], each row renormalised to sum to 1."""
    rows = torch.tensor([i for i, d in enumerate(dists) for _ in d.ids])  # [nnz]
    cols = torch.tensor([t for d in dists for t in d.ids])  # [nnz]
    q = torch.zeros(len(dists), vocab_size)  # [k, V]
    q[rows, cols] = torch.tensor([p for d in dists for p in d.probs])
    return (q / q.sum(-1, keepdim=True)).to(device)


class _BodyLimit:
    """ASGI middleware: a 413 for request bodies over `max_bytes` (by Content-Length, or counted while reading)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await _send_json(send, 400, "Content-Length is not a number")
            if int(length) > self.max_bytes:
                return await _send_json(send, 413, self._message(int(length)))
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            chunks.append(message)
            total += len(message.get("body", b""))
            more = message.get("more_body", False)
            if total > self.max_bytes:
                return await _send_json(send, 413, self._message(total))
        return await self.app(scope, _replay(chunks), send)

    def _message(self, size: int) -> str:
        return (
            f"request body of {size} bytes exceeds this server's limit of {self.max_bytes} bytes (--max-request-bytes)"
        )


def _replay(messages: list):
    queue = list(messages)

    async def receive():
        if queue:
            return queue.pop(0)
        return {"type": "http.disconnect"}

    return receive


async def _send_json(send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _bounded_models(vocab_size: int) -> tuple[type, type]:
    """Request models whose token ids are bounded by the vocabulary in the schema too (so the OpenAPI schema
    documents, and a fuzzer explores, the valid range)."""
    token_id = protocol.json_int(ge=0, lt=vocab_size)
    ids_field = Field(min_length=1, max_length=1024, description="token ids of the support")

    class SparseDistribution(protocol.SparseDistribution):
        ids: list[token_id] = ids_field

    draft_fields = {
        "draft_ids": (list[token_id], Field(default_factory=list, max_length=1 << 20)),
        "draft_probs": (list[SparseDistribution] | None, Field(default=None, max_length=1 << 20)),
    }
    create = create_model(
        "CreateSessionRequest",
        __base__=CreateSessionRequest,
        input_ids=(list[token_id], Field(min_length=1, max_length=1 << 20)),
        **draft_fields,
    )
    verify = create_model("VerifyRequest", __base__=VerifyRequest, last_token=(token_id, ...), **draft_fields)
    return create, verify


def create_app(state: ServingState) -> FastAPI:
    """The FastAPI application of one `ServingState` (OpenAPI schema at /openapi.json)."""
    Create, Verify = _bounded_models(state.vocab_size)
    app = FastAPI(
        title="moa-hf verification server",
        version=str(PROTOCOL_VERSION),
        description="Client-server speculative decoding with a Mixture-of-Attentions drafter.",
    )
    bearer = HTTPBearer(
        auto_error=False, description=f"required when the server has a token (--token or ${TOKEN_ENV_VAR})"
    )

    def authorize(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
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

    auth = [Depends(authorize)]

    @app.get("/v1/health", summary="liveness (no token needed)")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/info", dependencies=auth, responses=_ERRORS, summary="target, drafter fingerprint and limits")
    def info() -> dict:
        return state.info()

    @app.get("/v1/tokenizer", dependencies=auth, responses=_ERRORS, summary="the target's tokenizer files")
    def tokenizer() -> dict:
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
    def drafter() -> Response:
        return Response(state.drafter_blob(), media_type=_BINARY)

    @app.post(
        "/v1/sessions",
        dependencies=auth,
        response_class=Response,
        responses={**_ERRORS, **_BLOB},
        summary="create a session from verified tokens, verifying optional drafts",
    )
    def create_session(req: Create) -> Response:
        result = state.create(req)
        return Response(encode_result(result, req.context_format), media_type=_BINARY)

    @app.post(
        "/v1/sessions/{session_id}/verify",
        dependencies=auth,
        response_class=Response,
        responses={**_ERRORS, **_BLOB},
        summary="verify drafted tokens (one drafting cycle)",
    )
    def verify(session_id: str, req: Verify) -> Response:
        result = state.verify(session_id, req)
        return Response(encode_result(result, req.context_format), media_type=_BINARY)

    @app.delete(
        "/v1/sessions/{session_id}",
        dependencies=auth,
        status_code=204,
        response_class=Response,
        responses=_ERRORS,
        summary="end a session",
    )
    def delete_session(session_id: str) -> Response:
        if not state.delete(session_id):
            raise HTTPException(404, f"unknown session {session_id}")
        return Response(status_code=204)

    app.add_middleware(_BodyLimit, max_bytes=state.limits.max_request_bytes)
    return app


class ServerThread:
    """A uvicorn server for `app` in a background thread on host:port (port 0: a free one); `stop()` ends it and
    `start()` starts it again on the same port (for tests and benchmarks)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app, self.host, self.port, self.log_level = app, host, port, log_level
        self._server = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, app=None, timeout_s: float = 30.0) -> "ServerThread":
        import uvicorn

        if app is not None:
            self.app = app
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only then (else 40 ms per response)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level=self.log_level, timeout_graceful_shutdown=2, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"moa-serve-{self.port}"
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start within {timeout_s} s")
            time.sleep(0.01)
        self._sock = sock  # uvicorn serves on this socket object: keep it open until stop()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout_s)
        self._sock.close()
        self._server = self._thread = self._sock = None

    def __enter__(self) -> "ServerThread":
        return self if self._server is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
