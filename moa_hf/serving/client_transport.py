"""How `MoAClient` talks to its server (`ServerConnection`, the client's `connection`): the HTTP client, what an
answer's status means (unreachable, busy, session lost, refused), waiting for admission with jittered Retry-After
delays, the server's /v1/info, the verify calls (their request models, the checks of their answers, the retries of
corrupted ones) and the session's deletion."""

from __future__ import annotations

import json
import logging
import random
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from .client_types import ClientSettings, CorruptedAnswer, ServerBusy, ServingError, SessionLost, Unreachable
from .draft_policy import ClientDraftPolicy
from .protocol import (
    CONTENT_DIGEST_HEADER,
    PROTOCOL_VERSION,
    CreateSessionRequest,
    VerifyRequest,
    VerifyResult,
    check_content_digest,
    decode_result,
)

__all__ = ["ServerConnection"]

logger = logging.getLogger("moa_hf.serving.client")


class ServerConnection:
    """The connection of a `MoAClient` to the server at `server` (the client's `connection`).

    Its calls raise `Unreachable` (nothing answers, or a 5xx), `ServerBusy` (429, 503 with Retry-After, a timeout
    while /v1/health answers), `SessionLost` or `ServingError`; `fetch` turns the first two into `ConnectionError`.
    It keeps the server's /v1/info (`last_info`, None while the server has not answered) and why the server did not
    answer last (`unreachable`). A verify call reports its round trip to `policy`.
    """

    def __init__(
        self,
        server: str,
        settings: ClientSettings,
        policy: ClientDraftPolicy,
        transport: httpx.BaseTransport | None = None,
    ):
        s = settings
        self.server = server.rstrip("/")
        if transport is None:  # no Nagle delay between the request's header and body writes (40 ms per call)
            transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        self._http = httpx.Client(
            base_url=self.server,
            headers={"Authorization": f"Bearer {s.token}"} if s.token else {},
            transport=transport,
            timeout=httpx.Timeout(s.timeout_s, connect=s.connect_timeout_s),
        )
        self.policy = policy
        self.offline = s.offline
        self.context_format, self.want_context = s.context_format, s.draft_length != 0  # plain decoding: no context
        self.backoff_initial_s, self.backoff_max_s = s.backoff_initial_s, s.backoff_max_s
        self.admission_timeout_s, self.corrupt_retries = s.admission_timeout_s, s.corrupt_retries
        self.info_max_age_s = s.info_max_age_s
        self._rng = random.Random()  # jitter of the retry delays (clients retrying together spread out)
        self.last_info: dict | None = None  # the server's /v1/info; None while it has not answered (offline)
        self._info_at = 0.0
        self.unreachable = ""  # why the server did not answer last
        self._failed_at = -1e9  # when it did not (time.monotonic)

    def close(self) -> None:
        self._http.close()

    # -- requests ---------------------------------------------------------------------------------------------------
    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        if self.offline:
            raise Unreachable("offline mode: the client does not contact the server")
        try:
            response = self._http.request(method, path, **kwargs)
        except (httpx.ConnectError, httpx.ConnectTimeout) as err:  # nothing listens, or no route
            raise Unreachable(f"{type(err).__name__}: {err}") from err
        except httpx.TransportError as err:  # a timeout or a reset: unreachable only if its health is silent too
            why = f"{type(err).__name__} on {method} {path}"
            if self.answers_health():
                raise ServerBusy(f"{why}, but the server answers /v1/health", retry_after_s=0.5) from err
            raise Unreachable(f"{why}: {err}") from err
        self.raise_for_status(response, path)
        return response

    def answers_health(self) -> bool:
        """Whether the server answers GET /v1/health (never held up by the model) within a few seconds."""
        try:
            self._http.get("/v1/health", timeout=httpx.Timeout(5.0, connect=2.0))
        except httpx.TransportError:
            return False
        return True

    @staticmethod
    def raise_for_status(response: httpx.Response, path: str) -> None:
        status = response.status_code
        retry_after = response.headers.get("Retry-After")
        if status == 429 or (status == 503 and retry_after is not None):  # reachable, busy: wait for admission
            try:
                body = response.json()
            except ValueError:
                body = {}
            body = body if isinstance(body, dict) else {}
            try:
                seconds = max(0.0, float(retry_after if retry_after is not None else body.get("retry_after_s", 1)))
            except (TypeError, ValueError):  # an HTTP-date or garbage: one second
                seconds = 1.0
            detail = str(body.get("detail", response.text[:200]))
            raise ServerBusy(f"HTTP {status}: {detail}", retry_after_s=seconds, queue_depth=body.get("queue_depth"))
        if status >= 500:
            raise Unreachable(f"HTTP {status}: {response.text[:200]}")
        if status in (404, 409, 410) and "/sessions/" in path:
            raise SessionLost(response.text[:200])
        if status >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise ServingError(response.status_code, str(detail))

    def fetch(self, path: str, **kwargs) -> httpx.Response:
        """GET `path`, raising `ConnectionError` if the server is unreachable (not retried) or stays busy for
        `admission_timeout_s` (waited for as it asks)."""
        give_up_at = time.monotonic() + self.admission_timeout_s
        while True:
            try:
                return self.request("GET", path, **kwargs)
            except Unreachable as err:
                raise ConnectionError(f"cannot reach the server at {self.server} ({path}): {err}") from err
            except ServerBusy as err:
                left = give_up_at - time.monotonic()
                if left <= 0:
                    raise ConnectionError(
                        f"the server at {self.server} stayed busy for {self.admission_timeout_s:g} s ({path}): {err}"
                    ) from err
                time.sleep(min(self.retry_delay(err), left))

    def download(self, path: str, dest: Path) -> None:
        """Stream GET `path` into the file `dest`; `ConnectionError` if the server is unreachable or stops."""
        try:
            with self._http.stream("GET", path, timeout=httpx.Timeout(600.0, connect=10.0)) as response:
                if response.status_code >= 400:
                    response.read()
                    self.raise_for_status(response, path)
                with open(dest, "wb") as f:
                    for chunk in response.iter_bytes():
                        f.write(chunk)
        except httpx.TransportError as err:
            raise ConnectionError(
                f"cannot reach the server at {self.server} ({path}): the download broke off ({type(err).__name__})"
            ) from err
        except (Unreachable, ServerBusy) as err:
            raise ConnectionError(f"cannot reach the server at {self.server} ({path}): {err}") from err

    def retry_delay(self, busy: ServerBusy) -> float:
        """Seconds to wait before retrying a busy server: its Retry-After, plus up to a quarter more (at most 1 s)
        of jitter so that clients refused together do not come back together."""
        return busy.retry_after_s + self._rng.uniform(0.0, min(1.0, 0.25 * busy.retry_after_s + 0.05))

    # -- the server's /v1/info --------------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        """Whether the server answered last time the client asked (False while offline)."""
        return self.last_info is not None

    def forget(self, why: str | None = None) -> None:
        """Count the server as not answering (its /v1/info is read again before the next call); `why`: the reason,
        kept in `unreachable`."""
        self.last_info = None
        if why is not None:
            self.unreachable = why

    def info(self) -> dict:
        """The server's /v1/info (target, limits, drafter fingerprint and revision); raises if unreachable. Read
        again when older than `info_max_age_s` (a generation starting later notices a server upgrade)."""
        if self.last_info is None or time.monotonic() - self._info_at > self.info_max_age_s:
            self.last_info = None
            info = self.fetch("/v1/info").json()
            if info.get("protocol_version") != PROTOCOL_VERSION:
                raise ServingError(
                    400,
                    f"the server speaks protocol {info.get('protocol_version')}, this client "
                    f"{PROTOCOL_VERSION}: update moa-hf on one side",
                )
            self.last_info, self._info_at = info, time.monotonic()
        return self.last_info

    def try_info(self) -> dict | None:
        """/v1/info, or None when the server is unreachable (the reason goes to `unreachable`); not asked again
        within a second of such a failure (a dead link can take `connect_timeout_s` per attempt)."""
        if self.last_info is None and time.monotonic() - self._failed_at < 1.0:
            return None
        try:
            return self.info()
        except ConnectionError as err:
            self.unreachable, self._failed_at = str(err), time.monotonic()
            return None

    # -- verify calls -----------------------------------------------------------------------------------------------
    def call(self, run, sent: int, resync: Callable) -> VerifyResult:
        """Create or verify for the client's `run` (`client._Run`): the first `sent` pending tokens are verified.
        Re-creates a lost session once (after `resync(run)`, which re-reads /v1/info: a server that lost the session
        may have restarted with another drafter); asks again for a corrupted answer (a verify is idempotent: the
        server rolls back to the client's `num_verified`) up to `corrupt_retries` times, then counts the server as
        unreachable."""
        lost = corrupted = 0
        while True:
            path, request = self.payload(run, sent)
            data = json.dumps(request.model_dump(exclude_unset=True)).encode()  # the fields set: as the client gave
            t0 = time.perf_counter()
            try:
                response = self.request("POST", path, content=data, headers={"Content-Type": "application/json"})
                result = self.check_answer(run, response, sent)
            except SessionLost as err:
                if lost:
                    raise Unreachable("the session was lost twice in a row") from err
                lost += 1
                logger.info("session lost (%s): re-creating it from the %d verified tokens", err, len(run.verified))
                run.session_id = None
                run.recreations += 1
                self.forget()
                resync(run)
                continue
            except CorruptedAnswer as err:
                run.corrupted_answers += 1
                corrupted += 1
                if corrupted > self.corrupt_retries:
                    raise Unreachable(f"{corrupted} corrupted answers in a row ({err})") from err
                logger.warning("corrupted answer from %s (%s): asking again", path, err)
                time.sleep(min(self.backoff_max_s, self.backoff_initial_s * 2 ** (corrupted - 1)))
                continue
            rtt = time.perf_counter() - t0
            forward = len(run.verified) - (0 if path == "/v1/sessions" else len(run.verified) - 1) + sent
            run.calls += 1
            run.bytes_up += len(data)
            run.bytes_down += len(response.content)
            run.network_s += max(0.0, rtt - result.server_s)
            run.server_s += result.server_s
            server_s = result.server_s if path != "/v1/sessions" else None  # a prefill: not a drafting cycle
            self.policy.observe_call(rtt - result.server_s, server_s, forward, sent, result.accepted)
            run.session_id = result.session_id
            return result

    def payload(self, run, sent: int) -> tuple[str, CreateSessionRequest | VerifyRequest]:
        """(path, request) of the call verifying the first `sent` pending tokens: a create when the run has no
        session (with the sampling options, sent only when sampling: greedy decoding ignores them), else a verify.
        The request is the protocol's model, so that a wrong field fails here (pydantic's `ValidationError`), not
        as the server's 422."""
        drafts = run.pending[:sent]
        body = {
            "draft_ids": drafts,
            "context_from": run.cache.context_length,  # 0 after the client switched drafters (in a new session)
            "context_format": self.context_format,
            "want_context": self.want_context,
        }
        if run.sampling["do_sample"] and drafts:
            body["draft_probs"] = run.dists[:sent]
        if run.session_id is not None:
            path = f"/v1/sessions/{run.session_id}/verify"
            return path, VerifyRequest(**body, num_verified=len(run.verified), last_token=run.verified[-1])
        sampling = {}
        if run.sampling["do_sample"]:
            sampling = {k: v for k, v in run.sampling.items() if v is not None}
            if "seed" in sampling:  # a re-created session draws a fresh random stream
                sampling["seed"] = (sampling["seed"] + 1_000_003 * run.recreations) % (1 << 63)
        remaining = run.max_new_tokens - run.generated  # what the server reserves memory for
        return "/v1/sessions", CreateSessionRequest(
            **body, input_ids=run.verified, max_new_tokens=remaining, **sampling
        )

    def check_answer(self, run, response: httpx.Response, sent: int) -> VerifyResult:
        """The decoded answer to a call verifying `sent` pending tokens; `CorruptedAnswer` unless it is a safetensors
        blob matching its Content-Digest whose fields fit the client's state (`run.vocab`: the drafter's vocabulary
        size)."""
        content_type = response.headers.get("content-type", "")
        if not content_type.startswith("application/octet-stream"):
            raise CorruptedAnswer(f"content type {content_type!r}, not application/octet-stream")
        try:
            check_content_digest(response.content, response.headers.get(CONTENT_DIGEST_HEADER))
            result = decode_result(response.content)
        except ValueError as err:
            raise CorruptedAnswer(str(err)) from err
        a, n = result.accepted, len(run.verified)
        if not result.session_id or not 0 <= a <= sent or not 0 <= result.next_token < run.vocab:
            raise CorruptedAnswer(f"inconsistent answer (accepted {a} of {sent}, next token {result.next_token})")
        if result.num_verified != n + a + 1:
            raise CorruptedAnswer(f"the server holds {result.num_verified} tokens, the client expected {n + a + 1}")
        if self.want_context and result.context is None:
            raise CorruptedAnswer("the answer carries no context vectors")
        if result.context is not None:
            if result.context_start > run.cache.context_length:
                raise CorruptedAnswer(f"context gap: have {run.cache.context_length}, got from {result.context_start}")
            rows = result.num_verified - 1 - result.context_start  # context of [context_start, n + a)
            if result.context.shape[0] != rows:
                raise CorruptedAnswer(f"{result.context.shape[0]} context vectors for {rows} positions")
        return result

    def end_session(self, run) -> None:
        """Delete the run's server session (best effort: an unreachable server reaps it by its idle timeout)."""
        if run.session_id is None or self.offline:
            return
        session_id, run.session_id = run.session_id, None
        try:
            self._http.delete(f"/v1/sessions/{session_id}", timeout=2.0)
        except httpx.HTTPError:
            pass
