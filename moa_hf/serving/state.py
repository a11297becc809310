"""The verification server's state, apart from its HTTP routes (server.py): `ServingState` holds the target (and the
drafter's LSA), its sessions (`Session`: one per generation, the target's cache of its verified tokens), their
admission against `ServerLimits` and a memory budget, the scheduler that verifies them in batches, and what
`/v1/info` and the drafter download announce."""

import asyncio
import base64
import copy
import os
import secrets
import tempfile
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from fastapi import HTTPException
from transformers import DynamicCache

from ..chat import eos_token_ids
from ..modeling import PRIMARY_TARGET, CacheReader, oldest_held_position, target_fingerprint
from ..speculative import sampling_warpers, verify
from .batching import Admission, Job, JobAbandoned, Scheduler, SchedulerClosed
from .protocol import (
    CONTEXT_FORMATS,
    PROTOCOL_VERSION,
    CreateSessionRequest,
    SparseDistribution,
    VerifyRequest,
    VerifyResult,
    check_max_new_tokens,
    check_sampling,
    content_digest,
    download_digests,
    download_revision,
    encode_drafter,
    lsa_fingerprint,
    tokenizer_file_bytes,
)
from .target_hidden import HiddenRecordingCache

__all__ = ["ClientGone", "ServerLimits", "ServingState", "Session", "accept_drafts", "default_memory_budget"]


@dataclass
class ServerLimits:
    """Configurable limits: `moa serve`'s options (through `HfArgumentParser`); docs/serving.md says why these
    defaults."""

    max_sessions: int = field(default=32, metadata={"help": "sessions at once (default: 32 = --max-batch)"})
    max_tokens_per_session: int = 4096
    max_draft_tokens: int = field(default=64, metadata={"help": "most drafted tokens per verification call"})
    session_ttl_s: float = field(default=60.0, metadata={"help": "idle sessions expire after this"})
    max_request_bytes: int = 1 << 20
    # load
    max_batch: int = field(default=32, metadata={"help": "sessions' calls verified in one scheduler tick"})
    prefill_chunk: int = field(default=256, metadata={"help": "prompt tokens per session per tick"})
    admission_wait_s: float = field(
        default=20.0, metadata={"help": "a new session waits this long for room, then 429"}
    )
    max_queue: int = field(default=64, metadata={"help": "new sessions waiting for room; more get 429 at once"})
    memory_budget_bytes: int | None = field(
        default=None,
        metadata={
            "help": "the sessions' projected caches, in bytes (or --memory-budget-gb); None: 25%% of the device's"
        },
    )
    # context replies
    max_context_reply: int = field(default=512, metadata={"help": "tokens a call's context_from may reach back"})
    context_reread_factor: float = 2.0  # re-read tokens per session, at most this times its length
    # slow clients (uvicorn, `TimedH11Protocol`)
    header_timeout_s: float = field(default=10.0, metadata={"help": "a request's headers must arrive within this"})
    body_timeout_s: float = field(default=20.0, metadata={"help": "its body within this after the headers"})


@dataclass(eq=False)
class Session:
    id: str
    verified: list[int]  # every verified token; the cache holds keys/values of verified[:cache length]
    cache: DynamicCache
    request: CreateSessionRequest
    generator: torch.Generator | None
    last_used: float = field(default_factory=time.monotonic)
    created: float = field(default_factory=time.monotonic)
    reserved_tokens: int = 0  # prompt + max_new_tokens + drafts: verified + drafted tokens may not exceed it
    reserved_bytes: int = 0  # what admission holds for it
    registered: bool = False  # in the session table (its create finished for a client still there)
    job: Job | None = None  # the call being verified now
    job_key: tuple | None = None
    last_key: tuple | None = None  # the last verify call and its answer: an identical repeat gets the same answer
    last_result: VerifyResult | None = None
    reread: int = 0  # context tokens sent again (context_from before the first new position), all calls


class ClientGone(Exception):
    """The client of a create went away before its answer: the session is gone too."""


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of one token in the target's cache: layers x 2 (keys, values) x kv heads x head dim x dtype size (a
    sliding-window layer holds fewer tokens: an upper bound)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def default_memory_budget(device: torch.device) -> int:
    """25% of the memory that holds the sessions' caches: the GPU's on CUDA, else the machine's RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 4
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (AttributeError, ValueError, OSError):  # not POSIX: assume a 32 GB machine
        return 8 << 30


class ServingState:
    """The models, limits and live sessions of one server. The model runs in the scheduler thread only; `lock`
    guards the session table for the short bookkeeping of handlers and the scheduler (never held during a forward)."""

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
        name = drafter.check_target(target, allow_other_target=allow_other_target)  # by weights (fingerprint)
        self.target = target.eval()
        if drafter.dtype != target.dtype or drafter.device != target.device:  # a copy: leave the caller's as it is
            drafter = copy.deepcopy(drafter).to(device=target.device, dtype=target.dtype)
        self.drafter = drafter.eval()
        if hasattr(drafter, "select_target"):  # a drafter serving several targets: this target's parts
            drafter.select_target(name or PRIMARY_TARGET)
        self.tokenizer = tokenizer
        self.limits = replace(limits or ServerLimits())
        if self.limits.memory_budget_bytes is None:
            self.limits.memory_budget_bytes = default_memory_budget(target.device)
        self.token = token
        self.vocab_size = int(target.get_output_embeddings().weight.shape[0])
        self.device = target.device
        self.fingerprint = lsa_fingerprint(self.drafter)
        self.target_fingerprint = target_fingerprint(self.target)
        self.bytes_per_token = kv_bytes_per_token(target.config, target.dtype)
        self.reads_hidden = bool(getattr(self.drafter.config, "context_final_hidden", False))
        if self.reads_hidden:  # its sessions' caches also keep the target's final hidden states
            self.bytes_per_token += target.get_input_embeddings().weight.shape[1] * target.dtype.itemsize
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.expired: deque[str] = deque(maxlen=1024)
        self.lock = threading.Lock()
        self.closed = False
        limits = self.limits
        self.admission = Admission(
            limits.max_sessions, limits.memory_budget_bytes, limits.max_queue, limits.admission_wait_s, self._usage
        )
        self.scheduler = Scheduler(
            self.target,
            max_batch=limits.max_batch,
            prefill_chunk=limits.prefill_chunk,
            on_idle=self._reap,
            idle_every_s=min(1.0, max(0.05, limits.session_ttl_s / 4)),
        )
        # What a client downloads, built once: its revision tells a client whether its cached copy is current.
        self._drafter_blob = encode_drafter(self.drafter, self.target)
        self._drafter_digest = content_digest(self._drafter_blob)
        self._tokenizer_files = saved_tokenizer_files(tokenizer) if tokenizer is not None else None
        files = tokenizer_file_bytes(self._tokenizer_files) if tokenizer is not None else None
        self.revision = download_revision(download_digests(self._drafter_blob, files))
        self.eos_token_ids = eos_token_ids(target)

    # -- what the server tells ----------------------------------------------------------------------------------
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

    def health(self) -> dict:
        """Liveness and load, read without waiting for anything (the scheduler may be mid-forward)."""
        admission = self.admission
        return {
            "status": "draining" if admission.draining else "ok",
            "sessions": admission.sessions,
            "max_sessions": self.limits.max_sessions,
            "queue_depth": admission.queue_depth,
            "active_batch": self.scheduler.active_batch,
            "memory_used_bytes": admission.used_bytes,
            "memory_budget_bytes": admission.budget_bytes,
        }

    def drafter_blob(self) -> bytes:
        return self._drafter_blob

    def tokenizer_files(self) -> dict[str, dict[str, str]]:
        """The tokenizer's saved files: {"files": {name: text}, "binary_files": {name: base64}}."""
        return self._tokenizer_files

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def set_draining(self, draining: bool) -> None:
        """Shutting down (True): new sessions get 503 with Retry-After, the waiting ones too; False: serve again."""
        if draining:
            self.admission.drain()
        else:
            self.admission.draining = False

    def close(self) -> None:
        """Stop serving: refuse new sessions, stop the scheduler thread, drop every session."""
        self.set_draining(True)
        self.closed = True
        self.scheduler.close()
        with self.lock:
            for sid in list(self.sessions):
                self._drop(self.sessions[sid])

    def __enter__(self) -> "ServingState":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- session table (callers hold `lock`) ------------------------------------------------------------------------
    def _usage(self) -> tuple[int, int]:
        """(sessions, reserved bytes) of the session table, for admission (a snapshot: no lock needed)."""
        sessions = list(self.sessions.values())
        return len(sessions), sum(s.reserved_bytes for s in sessions)

    def _drop(self, session: Session, expired: bool = False) -> None:
        """Remove a session from the table (its memory is free for admission from now on)."""
        if self.sessions.pop(session.id, None) is None:
            return
        session.registered = False
        if expired:
            self.expired.append(session.id)
        self.admission.wake(time.monotonic() - session.created)

    def _reap(self) -> None:
        """Sessions idle for over `session_ttl_s` (no call running) expire (the scheduler calls this every second)."""
        now, ttl = time.monotonic(), self.limits.session_ttl_s
        with self.lock:
            for session in [s for s in self.sessions.values() if s.job is None and now - s.last_used > ttl]:
                self._drop(session, expired=True)

    # -- checks -------------------------------------------------------------------------------------------------
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

    def _check_create(self, req: CreateSessionRequest) -> None:
        self._check_ids("input_ids", req.input_ids)
        try:
            check_sampling(req.temperature, req.top_p, req.top_k, req.do_sample, vocab_size=self.vocab_size)
            if req.max_new_tokens is not None:
                check_max_new_tokens(req.max_new_tokens, len(req.input_ids), self.limits.max_tokens_per_session)
        except ValueError as err:
            raise HTTPException(422, str(err)) from None
        self._check_drafts(req, len(req.input_ids) + len(req.draft_ids) + 1)
        self._check_probs(req.draft_ids, req.draft_probs, req.do_sample)
        if req.context_from is not None and req.context_from > len(req.input_ids):
            raise HTTPException(422, f"context_from={req.context_from} is past the {len(req.input_ids)} input_ids")

    def _reservation(self, req: CreateSessionRequest) -> tuple[int, int]:
        """(tokens, bytes) a new session reserves: its prompt, the tokens it will generate and one call's drafts."""
        limits = self.limits
        new = req.max_new_tokens if req.max_new_tokens is not None else limits.max_tokens_per_session
        tokens = min(len(req.input_ids) + new, limits.max_tokens_per_session) + limits.max_draft_tokens
        return tokens, tokens * self.bytes_per_token

    def _verify_context_start(self, session: Session, req: VerifyRequest, cached: int) -> tuple[int, int]:
        """(first context position to send, tokens re-read before the first new one): `context_from` reaches back at
        most `max_context_reply` tokens per call and `context_reread_factor` x the session's length in all."""
        if req.context_from is not None and req.context_from > req.num_verified:
            raise HTTPException(422, f"context_from={req.context_from} is past the {req.num_verified} verified tokens")
        if not req.want_context:  # nothing is sent: context_from does not matter
            return cached, 0
        if req.context_from is None or req.context_from >= cached:
            return (cached if req.context_from is None else req.context_from), 0
        back = cached - req.context_from
        limit = self.limits.max_context_reply
        if back > limit:
            raise HTTPException(
                422,
                f"context_from={req.context_from} reaches back {back} tokens, over this server's limit of {limit} per "
                "call (--max-context-reply): create a new session (its answer carries the whole context)",
            )
        total = int(self.limits.context_reread_factor * req.num_verified)
        if session.reread + back > total:
            raise HTTPException(
                422,
                f"this session has re-read {session.reread} context tokens; {back} more would exceed its limit of "
                f"{total} ({self.limits.context_reread_factor:g} x its {req.num_verified} tokens): create a new "
                "session",
            )
        return req.context_from, back

    # -- endpoints ------------------------------------------------------------------------------------------------
    async def create(self, req: CreateSessionRequest, gone=None) -> VerifyResult:
        """A new session from `req.input_ids` (admitted first: it may wait for room), verifying its drafts. `gone()`:
        an awaitable that completes when the client disconnects: the create is then dropped with its session."""
        self._check_create(req)
        tokens, cost = self._reservation(req)
        work = asyncio.ensure_future(self._create(req, tokens, cost))
        if gone is None:
            return await work
        watch = asyncio.ensure_future(gone())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():  # the client went away (or this handler was cancelled): drop the create
                work.cancel()
                work.add_done_callback(outcome_unread)
        if not work.done():
            raise ClientGone("the client closed the connection before its session was created")
        return work.result()

    async def _create(self, req: CreateSessionRequest, tokens: int, cost: int) -> VerifyResult:
        try:
            await self.admission.acquire(cost)
        except ValueError as err:  # larger than the whole budget
            raise HTTPException(422, str(err)) from None
        try:
            job, session = self._submit_create(req, tokens, cost)
        except BaseException:
            self.admission.settle(cost)
            raise
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:  # the client went away
            with self.lock:
                job.abandon()
                self._drop(session)
            raise
        except JobAbandoned:
            raise ClientGone("the client went away") from None

    def _submit_create(self, req: CreateSessionRequest, tokens: int, cost: int) -> tuple[Job, Session]:
        generator = None
        if req.do_sample:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(req.seed if req.seed is not None else secrets.randbits(63))
        session = Session(
            id=secrets.token_urlsafe(16),
            verified=list(req.input_ids),
            cache=(HiddenRecordingCache if self.reads_hidden else DynamicCache)(config=self.target.config),
            request=req,
            generator=generator,
            reserved_tokens=tokens,
            reserved_bytes=cost,
        )
        # sliding-window layers keep the states a rejected draft needs until `crop` (as assisted generation does)
        session.cache.activate_past_recording()
        start = 0 if req.context_from is None else req.context_from
        job = Job(session.id, session.cache, list(req.input_ids) + list(req.draft_ids), len(req.draft_ids) + 1, None)
        job.finish = self._finisher(session, job, req, start, create=True)
        self.scheduler.submit(job)
        job.future.add_done_callback(lambda future: self.admission.settle(cost))  # registered (or failed) by then
        return job, session

    async def verify(self, session_id: str, req: VerifyRequest) -> VerifyResult:
        self._check_ids("last_token", [req.last_token])
        if self.closed:
            raise SchedulerClosed("the server is shutting down")
        key = call_key(req)
        with self.lock:
            now = time.monotonic()
            session = self.sessions.get(session_id)
            if session is not None and session.job is None and now - session.last_used > self.limits.session_ttl_s:
                self._drop(session, expired=True)
                session = None
            if session is None:
                if session_id in self.expired:
                    raise HTTPException(
                        410,
                        f"session {session_id} expired (idle over {self.limits.session_ttl_s:g} s);"
                        " create a new one with the verified prefix",
                    )
                raise HTTPException(404, f"unknown session {session_id}; create one with POST /v1/sessions")
            session.last_used = now
            if session.job is not None:
                if session.job_key != key:
                    raise HTTPException(
                        409,
                        f"session {session_id} is verifying another call; wait for its answer (calls of a session "
                        "are sequential)",
                    )
                job = session.job  # the same call again (the client timed out): the same answer
            elif key == session.last_key and len(session.verified) == session.last_result.num_verified:
                return session.last_result  # a repeat of the last call whose answer was lost: the same answer
            else:
                job = self._start_verify(session, req, key)
        return await asyncio.shield(asyncio.wrap_future(job.future))

    def _start_verify(self, session: Session, req: VerifyRequest, key: tuple) -> Job:
        """Check a verify call against its session and submit its job (caller holds `lock`)."""
        n = len(session.verified)
        if req.num_verified > n or session.verified[req.num_verified - 1] != req.last_token:
            raise HTTPException(
                409,
                f"the client holds {req.num_verified} verified tokens ending in {req.last_token}, the "
                f"session {n}; create a new session with the client's verified prefix",
            )
        self._check_drafts(req, req.num_verified + len(req.draft_ids) + 1)
        if req.num_verified + len(req.draft_ids) > session.reserved_tokens:
            raise HTTPException(
                422,
                f"the session would hold {req.num_verified + len(req.draft_ids) + 1} tokens, over the "
                f"{session.reserved_tokens} it reserved (its prompt, max_new_tokens and --max-draft-tokens): create "
                "the session with a larger max_new_tokens",
            )
        self._check_probs(req.draft_ids, req.draft_probs, session.request.do_sample)
        cached = min(session.cache.get_seq_length(), req.num_verified - 1)  # after a rollback to the client's state
        start, back = self._verify_context_start(session, req, cached)
        tokens = session.verified[cached : req.num_verified] + list(req.draft_ids)
        job = Job(session.id, session.cache, tokens, keep=len(req.draft_ids) + 1, finish=None)
        if req.num_verified < n:  # an answer was lost on the way back: roll back to what the client holds

            def rollback() -> None:
                del session.verified[req.num_verified :]
                crop_to(session.cache, req.num_verified - 1)

            job.prepare = rollback
        job.finish = self._finisher(session, job, req, start, key=key, reread=back)
        session.job, session.job_key = job, key
        job.future.add_done_callback(lambda future: self._verify_done(session, job))
        try:
            self.scheduler.submit(job)
        except SchedulerClosed:
            session.job = session.job_key = None
            raise
        return job

    def _verify_done(self, session: Session, job: Job) -> None:
        """A verify's call ended (scheduler thread): a failed one drops its session (its cache may be half-updated)."""
        with self.lock:
            if session.job is job:
                session.job = session.job_key = None
            if not job.future.cancelled() and job.future.exception() is not None:
                self._drop(session)

    def delete(self, session_id: str) -> bool:
        with self.lock:
            session = self.sessions.get(session_id)
            if session is None:
                return False
            self._drop(session)
            return True

    # -- the model's side (scheduler thread) ------------------------------------------------------------------------
    def _finisher(self, session: Session, job: Job, req, context_start: int, create=False, key=None, reread=0):
        submitted = time.perf_counter()

        def finish(logits: torch.Tensor) -> VerifyResult:
            result = self._accept_and_read(session, req, logits, context_start, submitted)
            with self.lock:
                session.last_used = time.monotonic()
                if create:
                    if job.abandoned:
                        return result  # the client went away: the session is not kept
                    session.registered = True
                    self.sessions[session.id] = session
                else:
                    session.last_key, session.last_result = key, result
                    session.reread += reread
            return result

        return finish

    def _accept_and_read(self, session: Session, req, logits: torch.Tensor, context_start: int, submitted: float):
        """Accept the drafts on the target's logits [k+1, V] (after verified[-1], d_1, ..., d_k), crop the cache to
        the verified tokens, read the context vectors of [context_start, new length)."""
        drafts = list(req.draft_ids)
        accepted, next_token = accept_drafts(logits, drafts, req.draft_probs or [], session)
        n = len(session.verified)
        new_len = n + accepted  # keys/values kept for verified + accepted drafts; next_token has none yet
        crop_to(session.cache, new_len)
        session.verified.extend(drafts[:accepted] + [next_token])
        context, valid_from = None, 0
        if req.want_context:
            start = min(context_start, new_len)
            # the server's reader: the session's cache, which also records the hidden states (`HiddenRecordingCache`)
            reader = CacheReader(session.cache, session.cache.hidden_between if self.reads_hidden else None)
            context = self.drafter.read_context(reader, start, new_len)  # [1, T, d]
            context = context[0].float().cpu()  # [T, d]
            valid_from = oldest_held_position(session.cache)  # older positions were read as zeros
        return VerifyResult(
            session_id=session.id,
            num_verified=len(session.verified),
            accepted=accepted,
            next_token=next_token,
            context_start=context_start,
            server_s=time.perf_counter() - submitted,  # in the server: waiting for a batch, then the forward
            context=context,
            context_valid_from=valid_from,
        )


def outcome_unread(task: asyncio.Task) -> None:
    """A dropped task's outcome, read so that asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


def call_key(req: VerifyRequest) -> tuple:
    """What makes two verify calls the same call (the answer's format aside)."""
    probs = tuple((tuple(d.ids), tuple(d.probs)) for d in req.draft_probs) if req.draft_probs is not None else None
    return (req.num_verified, req.last_token, tuple(req.draft_ids), probs, req.context_from, req.want_context)


def saved_tokenizer_files(tokenizer) -> dict[str, dict[str, str]]:
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


def crop_to(cache: DynamicCache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def accept_drafts(logits: torch.Tensor, drafts: list[int], dists: list[SparseDistribution], session: Session):
    """(accepted, next token) for the target's logits [k+1, V]: greedy, or speculative sampling with the session's
    temperature, top-k and top-p and the drafter's sparse distributions as q (see `moa_hf.speculative`)."""
    r = session.request
    warpers = sampling_warpers(r.temperature, r.top_k, r.top_p) if r.do_sample else None
    draft_ids = torch.tensor(drafts, dtype=torch.long, device=logits.device)  # [k]
    q = draft_q(dists, logits.shape[-1], logits.device) if warpers is not None and drafts else None
    return verify(logits, draft_ids, warpers, q, session.generator)


def draft_q(dists: list[SparseDistribution], vocab_size: int, device) -> torch.Tensor:
    """The drafter's sparse distributions -> q [k, V], each row renormalised to sum to 1."""
    rows = torch.tensor([i for i, d in enumerate(dists) for _ in d.ids])  # [nnz]
    cols = torch.tensor([t for d in dists for t in d.ids])  # [nnz]
    q = torch.zeros(len(dists), vocab_size)  # [k, V]
    q[rows, cols] = torch.tensor([p for d in dists for p in d.probs])
    return (q / q.sum(-1, keepdim=True)).to(device)
