"""The drafting client: holds the drafter, drafts locally, asks a `moa serve` server to verify (one call per cycle).

A server that answers but is full (429, or 503 while it starts or stops, with Retry-After) is waited for: the client
retries after the delay it asks for, up to `admission_timeout_s`, and drafts nothing meanwhile. Only when the server
is unreachable (connection refused or reset, no answer even to /v1/health) or that admission wait ran out does the
client keep generating with its drafter alone (those tokens are marked unverified, and the result says so), retry
with exponential backoff, and on reconnection have the pending tokens verified, correcting from the first rejected
one. Verified tokens are never dropped. A corrupted answer (unparseable, wrong content type, digest mismatch,
inconsistent fields) is retried as it was sent. The session is deleted when the generation ends, however it ends.
The draft length adapts to the measured round-trip time, server time, drafting time and acceptance (more tokens per
call, so fewer calls, when the network is slow).

The server's drafter and tokenizer are kept in a local cache (`cache.DrafterCache`, one folder per revision): a
client downloads them only when the server announces a revision it does not hold, and a client whose server is
down at start generates with the newest cached copy from the first token (unverified until the server is back).

The HTTP side (requests, what a status means, admission waits, /v1/info, the verify calls, the checks of their answers
and the session's deletion) is the client's `connection`, a `ServerConnection` (client_transport.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import torch

from ..chat import chat_ids, eos_token_ids
from ..modeling import MoADrafterCache
from ..modeling.chain import draft_chain
from ..speculative import sampling_warpers
from .cache import DrafterCache
from .client_drafter import ClientDrafterMixin
from .client_transport import ServerConnection
from .client_types import ClientSettings, GenerationEvent, GenerationResult, ServingError
from .client_types import ServerBusy as _Busy
from .client_types import Unreachable as _Unreachable
from .draft_policy import ClientDraftPolicy
from .protocol import VerifyResult, check_max_new_tokens, check_sampling, lsa_fingerprint

__all__ = ["ClientSettings", "GenerationEvent", "GenerationResult", "MoAClient", "ServingError"]

logger = logging.getLogger(__name__)


class _TextStream:
    """Incremental detokenization: the new text of a growing token list (holds back incomplete characters)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.emitted = tokenizer, ""

    def push(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted) :], text
        return delta


@dataclass
class _Run:
    prompt: list[int]
    verified: list[int]
    max_new_tokens: int
    sampling: dict
    cache: MoADrafterCache = field(default_factory=MoADrafterCache)
    pending: list[int] = field(default_factory=list)
    dists: list = field(default_factory=list)  # with sampling: the sparse q of each pending token
    session_id: str | None = None
    calls: int = 0
    failed_calls: int = 0
    recreations: int = 0
    drafted: int = 0
    lookup_drafted: int = 0  # of `drafted`: proposed by the drafter's prompt lookup
    accepted_lengths: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    bytes_up: int = 0
    bytes_down: int = 0
    network_s: float = 0.0
    server_s: float = 0.0
    draft_s: float = 0.0
    first_token_s: float | None = None  # the first verified token
    first_unverified_s: float | None = None  # the first token shown unverified (drafted while offline)
    offline_spans: list[dict] = field(default_factory=list)
    busy_answers: int = 0  # 429/503 (or timeouts of a live server) waited for
    admission_wait_s: float = 0.0  # time spent waiting for them
    corrupted_answers: int = 0
    vocab: int = 0  # the drafter's vocabulary size (the token ids an answer may hold)
    shown: int = 0  # leading pending tokens already shown as unverified
    generator: torch.Generator | None = None  # the drafter's sampling RNG (seeded with `seed`)
    done: bool = False

    @property
    def generated(self) -> int:
        return len(self.verified) - len(self.prompt)


def _top_k_sampler(warpers, top_k: int, run: _Run):
    """`draft_chain`'s `sample` for a sampling client: q, the drafter's warped distribution on its top-k tokens
    (recorded in `run.dists`), sampled with the run's generator."""

    def sample(ids: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, None]:
        scores = warpers(ids, logits)[0]  # [V]
        values, support = scores.topk(min(top_k, logits.shape[-1]))
        probs = values.softmax(-1)  # [top_k]
        run.dists.append({"ids": support.tolist(), "probs": probs.tolist()})
        return support[torch.multinomial(probs, 1, generator=run.generator)][None], None  # [1, 1]

    return sample


class MoAClient(ClientDrafterMixin):
    """Client of a `moa serve` server.

    ```python
    client = MoAClient("http://127.0.0.1:8000", drafter=drafter, tokenizer=tokenizer)
    result = client.generate("Why is the sky blue?", max_new_tokens=64)
    print(result.text, result.server_calls, result.unverified_tokens)
    ```

    Args:
        server: base URL of the server.
        drafter: a `MoADrafterModel` with `own_embeddings=True` (the same checkpoint the server runs; checked by
            the fingerprint of its LSA weights). None: the server's, from the cache when it holds the revision the
            server announces, else downloaded (and cached); the server unreachable, the newest cached copy.
        tokenizer: the target's tokenizer (for text prompts, the chat template and streaming). None: the one cached
            with the server's drafter, else downloaded from the server when needed.
        transport: an httpx transport (default: TCP without Nagle delay).
        settings: a `ClientSettings` (draft length, timeouts, retries, cache, offline, ...); its fields may also be
            given as keywords, which override it.

    Its parts: `connection` (a `ServerConnection`, client_transport.py: the HTTP calls, /v1/info, the verify calls
    and their retries), `policy` (a `ClientDraftPolicy`: the draft length) and `cache` (a `DrafterCache`).
    """

    settings_class = ClientSettings  # the keywords beside drafter, tokenizer, transport and settings

    def __init__(
        self,
        server: str,
        *,
        drafter=None,
        tokenizer=None,
        transport: httpx.BaseTransport | None = None,
        settings: ClientSettings | None = None,
        **overrides,
    ):
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(ClientSettings)})
        if unknown:
            known = ", ".join(f.name for f in dataclasses.fields(ClientSettings))
            raise TypeError(
                f"MoAClient got unknown keywords {unknown}; its settings are drafter, tokenizer, "
                f"transport, settings and the ClientSettings fields: {known}."
            )
        self.settings = s = dataclasses.replace(settings or ClientSettings(), **overrides)
        draft_length = s.draft_length
        min_draft_length, max_draft_length = s.min_draft_length, s.max_draft_length
        cache_dir, use_cache = s.cache_dir, s.use_cache
        if drafter is not None:
            self._check_standalone(drafter)
        self.policy = ClientDraftPolicy(min_draft_length, max_draft_length, fixed=draft_length)
        self.connection = ServerConnection(server, s, self.policy, transport)  # HTTP, /v1/info, the verify calls
        self.server = self.connection.server
        self.drafter = drafter.eval() if drafter is not None else None
        self.tokenizer = tokenizer
        self.draft_length = draft_length
        self.min_draft_length, self.max_draft_length = min_draft_length, max_draft_length
        self.context_format = s.context_format
        self.draft_top_k = s.draft_top_k
        self.backoff_initial_s, self.backoff_max_s = s.backoff_initial_s, s.backoff_max_s
        self.reconnect_timeout_s = s.reconnect_timeout_s
        self.admission_timeout_s = s.admission_timeout_s
        self.check_drafter = s.check_drafter
        self.offline = s.offline
        self.cache = DrafterCache(self.server, cache_dir) if use_cache else None
        self.revision: str | None = None  # the cached/downloaded drafter's revision (None: a drafter passed in)
        self._given_drafter, self._given_tokenizer = drafter is not None, tokenizer is not None
        self._fingerprint = lsa_fingerprint(self.drafter) if drafter is not None else None
        self._dtype = torch.float32
        self._cached_info: dict | None = None  # the server's /v1/info when the cached drafter was downloaded

    # -- plumbing ---------------------------------------------------------------------------------------------------
    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> MoAClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _check_standalone(drafter) -> None:
        c = drafter.config
        if not c.own_embeddings:
            raise ValueError(
                "The client's drafter must hold its own embedding and LM head: build it with "
                "`moa_hf.build_drafter(target, own_embeddings=True)` or let the client download it."
            )
        if c.target_layer_inference > 0:
            raise ValueError(
                "The client cannot run the target's last layers: use a drafter with target_layer_inference=0."
            )

    @property
    def connected(self) -> bool:
        """Whether the server answered last time the client asked (False while offline)."""
        return self.connection.connected

    def info(self) -> dict:
        """The server's /v1/info (target, limits, drafter fingerprint and revision); raises if unreachable. Read
        again when older than `info_max_age_s` (a generation starting later notices a server upgrade)."""
        return self.connection.info()

    def _sync(self, run: _Run) -> None:
        """The server answers again (after an offline start or an outage): re-read its /v1/info. When it now runs
        another drafter revision, switch to it (cached or downloaded) and restart the drafter's cache, whose context
        vectors came from the other drafter; the next call creates a new session, which answers with the context of
        every verified token (a verify re-reads at most the server's `max_context_reply` tokens).
        Raises `_Unreachable` while the server (or the download) does not answer."""
        try:
            info = self.info()
        except ConnectionError as err:
            raise _Unreachable(str(err)) from err
        if self._stale(info):
            revision = info["drafter"].get("revision")
            logger.warning("the server now runs drafter revision %s (this client had %s)", revision, self.revision)
            try:
                self._load_server_drafter(info, fall_back=False)
            except ConnectionError as err:
                self.connection.forget()
                raise _Unreachable(str(err)) from err
            run.cache = MoADrafterCache()
            self.connection.end_session(run)  # a new session sends the context of every verified token (not a verify)
        self._check_fingerprint(info)
        self._eos, run.vocab = self._eos_ids(), int(self.drafter.config.vocab_size)

    def _known_info(self) -> dict:
        """The server's /v1/info, else (offline) the one cached with the drafter, else {}."""
        return self.connection.last_info or self._cached_info or {}

    def _limits(self) -> dict:
        return self._known_info().get("limits", {})

    def _max_tokens(self) -> int | None:
        """The most tokens a session may hold on the server (None: not known, e.g. offline without a cache)."""
        info = self._known_info()
        bounds = [info.get("limits", {}).get("max_tokens_per_session"), info.get("max_context")]
        bounds = [b for b in bounds if isinstance(b, int)]
        return min(bounds) if bounds else None

    def _max_draft(self) -> int:
        return min(self.max_draft_length, self._limits().get("max_draft_tokens", self.max_draft_length))

    def _eos_ids(self) -> set[int]:
        eos = self._known_info().get("eos_token_ids")
        if eos is None:
            eos = eos_token_ids(self.drafter.config)
        return set(eos)

    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
        """Token ids of `prompt`, wrapped in the target's chat template as one user turn unless `raw`."""
        tokenizer = self.load_tokenizer()
        if raw or tokenizer.chat_template is None:
            if not raw:
                logger.warning("The tokenizer has no chat template: sending the prompt as raw text.")
            return list(tokenizer(prompt).input_ids)
        return chat_ids(tokenizer, prompt)

    # -- generation -------------------------------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, **kwargs) -> GenerationResult:
        """Generate to the end; see `iter_generate` for the arguments."""
        events = self.iter_generate(prompt, max_new_tokens, **kwargs)
        while True:
            try:
                next(events)
            except StopIteration as stop:
                return stop.value

    def stream(self, prompt: str | list[int], max_new_tokens: int = 128, **kwargs) -> Iterator[str]:
        """Yield the verified text as it is verified (and an unverified tail, if any, at the end)."""
        events = self.iter_generate(prompt, max_new_tokens, **kwargs)
        while True:
            try:
                event = next(events)
            except StopIteration as stop:
                result = stop.value
                if result.unverified_span is not None and self.tokenizer is not None:
                    start = result.unverified_span[0]
                    verified = self.tokenizer.decode(result.token_ids[:start], skip_special_tokens=True)
                    yield result.text[len(verified) :] if result.text.startswith(verified) else ""
                return
            if event.kind == "verified" and event.text:
                yield event.text

    def iter_generate(
        self,
        prompt: str | list[int],
        max_new_tokens: int = 128,
        *,
        raw: bool = False,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        on_event: Callable[[GenerationEvent], None] | None = None,
    ):
        """A generator of `GenerationEvent`s whose return value (StopIteration.value) is the `GenerationResult`.

        `prompt`: text (chat template applied unless `raw`) or token ids (used as they are). Greedy by default;
        `do_sample` samples with `temperature`, `top_k`, `top_p` (speculative sampling keeps the target's
        distribution exactly); `seed` seeds both sides, which makes runs repeatable with a fixed `draft_length`
        (an adaptive one depends on timings, and so does which random numbers are drawn).
        """
        t_start = time.perf_counter()
        check_max_new_tokens(max_new_tokens)  # checked before any request
        check_sampling(temperature, top_p, top_k, do_sample)
        if len(prompt) == 0:
            raise ValueError("The prompt is empty: give at least one token.")
        self.prepare()  # None: start offline, with the given or the newest cached drafter
        check_sampling(temperature, top_p, top_k, do_sample, vocab_size=int(self.drafter.config.vocab_size))
        prompt_ids = list(prompt) if not isinstance(prompt, str) else self.encode_prompt(prompt, raw=raw)
        if not prompt_ids:
            raise ValueError("The prompt is empty: give at least one token.")
        check_max_new_tokens(max_new_tokens, len(prompt_ids), self._max_tokens())
        run = _Run(
            prompt=prompt_ids,
            verified=list(prompt_ids),
            max_new_tokens=max_new_tokens,
            sampling=dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
        )
        if do_sample and seed is not None:
            run.generator = torch.Generator(device=self.drafter.device).manual_seed(seed)
        self._eos = self._eos_ids()
        run.vocab = int(self.drafter.config.vocab_size)

        def emit(event: GenerationEvent):
            if on_event is not None:
                on_event(event)
            return event

        try:
            yield from self._cycles(run, t_start, emit)
        finally:  # also when the generation raised or its consumer stopped early: free the server's memory now
            self.connection.end_session(run)
        return self._finish(run, t_start)

    def _cycles(self, run: _Run, t_start: float, emit: Callable[[GenerationEvent], GenerationEvent]):
        """The drafting cycles of `iter_generate` (a generator of its events)."""
        text = _TextStream(self.tokenizer)
        max_new_tokens = run.max_new_tokens
        offline_since: float | None = None  # when the server became unreachable (None: online)
        drafting_done_at: float | None = None  # offline, when every remaining token had been drafted
        busy_since: float | None = None  # when the server first answered "busy" in a row (None: it is not)
        backoff, next_retry = self.backoff_initial_s, 0.0
        start_offline = not self.connection.connected  # the server did not answer just now: draft from the first token
        while not run.done and run.generated < max_new_tokens:
            remaining = max_new_tokens - run.generated
            if offline_since is None:
                # no context from the target yet (first call): drafts would be blind, send the prompt alone
                k = self.policy.choose(remaining - 1 - len(run.pending)) if run.cache.context_length else 0
                self._draft(run, min(k, self._max_draft()))
            elif time.monotonic() < next_retry:
                if run.generated + len(run.pending) < max_new_tokens and not self._ends(run.pending):
                    position = run.generated + len(run.pending)
                    self._draft(run, 1)
                    run.shown = len(run.pending)
                    run.offline_spans[-1]["drafted"] += 1
                    if run.first_unverified_s is None:
                        run.first_unverified_s = time.perf_counter() - t_start
                    yield emit(GenerationEvent("unverified", run.pending[-1:], position=position))
                    continue
                if drafting_done_at is None:
                    drafting_done_at = time.monotonic()
                give_up_at = drafting_done_at + self.reconnect_timeout_s
                if self.offline or time.monotonic() >= give_up_at:
                    break  # the tail stays unverified
                time.sleep(max(0.0, min(next_retry, give_up_at) - time.monotonic()))
                continue
            try:
                if start_offline:
                    start_offline = False
                    raise _Unreachable(self.connection.unreachable)
                if not self.connection.connected:  # the first call since an offline start or an outage: re-read
                    self._sync(run)
                sent = min(len(run.pending), self._max_draft())
                result = self.connection.call(run, sent, resync=self._sync)
            except (_Busy, _Unreachable) as err:
                if isinstance(err, _Busy):  # reachable but full: wait as it asks, draft nothing meanwhile
                    now = time.monotonic()
                    if busy_since is None:
                        busy_since = now
                        yield emit(GenerationEvent("waiting", text=str(err), position=run.generated))
                    left = busy_since + self.admission_timeout_s - now
                    if left > 0:
                        delay = min(self.connection.retry_delay(err), left)
                        run.busy_answers += 1
                        run.admission_wait_s += delay
                        time.sleep(delay)
                        continue
                    err = _Unreachable(f"no admission within {self.admission_timeout_s:g} s ({err})")
                run.failed_calls += 1
                self.connection.forget()
                if offline_since is None:
                    offline_since = time.monotonic()
                    logger.warning("server unreachable (%s): drafting alone until it is back", err)
                    span = {"start": run.generated, "drafted": len(run.pending), "accepted": 0}
                    run.offline_spans.append({**span, "reconnected_after_s": None})
                    yield emit(GenerationEvent("offline", text=str(err), position=run.generated))
                    if run.pending:
                        run.shown = len(run.pending)
                        if run.first_unverified_s is None:
                            run.first_unverified_s = time.perf_counter() - t_start
                        yield emit(GenerationEvent("unverified", list(run.pending), position=run.generated))
                else:
                    backoff = min(backoff * 2, self.backoff_max_s)
                next_retry = time.monotonic() + backoff
                continue
            busy_since = None
            position, shown, before = run.generated, run.shown, list(run.pending)
            new, confirmed = self._apply(run, result, sent)
            if shown:  # some pending tokens had been shown as unverified
                run.offline_spans[-1]["accepted"] += min(confirmed, shown)
                run.shown = max(0, shown - confirmed) if run.pending else 0
                dropped = before[confirmed:shown] if not run.pending else []
                if dropped:
                    yield emit(GenerationEvent("rollback", dropped, position=position + confirmed))
            if offline_since is not None:
                run.offline_spans[-1]["reconnected_after_s"] = round(time.monotonic() - offline_since, 4)
                offline_since, drafting_done_at, backoff = None, None, self.backoff_initial_s
                yield emit(GenerationEvent("online", position=position))
            if run.first_token_s is None:
                run.first_token_s = time.perf_counter() - t_start
            yield emit(GenerationEvent("verified", new, text.push(run.verified[len(run.prompt) :]), position))

    # -- one cycle --------------------------------------------------------------------------------------------------
    def _ends(self, tokens: list[int]) -> bool:
        return bool(tokens) and tokens[-1] in self._eos

    @torch.no_grad()
    def _draft(self, run: _Run, k: int) -> None:
        """Append up to `k` drafted tokens to `run.pending` (stops after an EOS)."""
        if k <= 0 or self._ends(run.pending):
            return
        t0 = time.perf_counter()
        drafter, cache = self.drafter, run.cache
        s = run.sampling
        ids = torch.tensor([run.verified + run.pending], device=drafter.device)  # [1, T]
        eos = torch.tensor(sorted(self._eos), dtype=torch.long, device=drafter.device)
        looked_up = drafter.lookup_proposal(ids, k, 0, eos)  # None when the drafter's lookup is off or finds nothing
        if looked_up is not None:  # free draft tokens, q one-hot (exact); the SA cache catches up later
            tokens = looked_up.tolist()
            run.pending.extend(tokens)
            run.dists.extend({"ids": [t], "probs": [1.0]} if s["do_sample"] else None for t in tokens)
            run.drafted += len(tokens)
            run.lookup_drafted += len(tokens)
            run.draft_s += time.perf_counter() - t0
            return
        warpers, top_k = None, self.draft_top_k
        if s["do_sample"]:
            top_k = min(self.draft_top_k, s["top_k"]) if s["top_k"] > 0 else self.draft_top_k
            warpers = sampling_warpers(s["temperature"], top_k=top_k)
        keep = min(cache.common_prefix(ids), ids.shape[1] - 1)
        cache.truncate(keep)  # rolls back rejected tokens; a new drafting call (a block drafter: a new block)

        def next_logits(token: torch.Tensor | None) -> torch.Tensor:  # [1, V]
            return drafter.draft_step(ids[:, cache.get_seq_length() :] if token is None else token, cache)

        sample = None if warpers is None else _top_k_sampler(warpers, top_k, run)
        chain = draft_chain(next_logits, k, eos=eos, ids=ids if sample else None, sample=sample)
        tokens = chain.lists()[0]
        if warpers is None:  # greedy (also sampling at a temperature below MIN_TEMPERATURE): q one-hot
            run.dists.extend({"ids": [t], "probs": [1.0]} if s["do_sample"] else None for t in tokens)
        run.pending.extend(tokens)
        n = len(tokens)
        seconds = time.perf_counter() - t0
        run.drafted += n
        run.draft_s += seconds
        self.policy.observe_draft(seconds / max(n, 1))

    def _apply(self, run: _Run, result: VerifyResult, sent: int) -> tuple[list[int], int]:
        """Take the server's verdict on the first `sent` pending tokens. Returns the newly verified tokens and how
        many of them were pending tokens (the accepted ones, plus the next one when the target's token equals it)."""
        a = result.accepted  # checked against the client's state by `connection.check_answer`
        new = run.pending[:a] + [result.next_token]
        confirmed = a
        if a == sent and len(run.pending) > sent and run.pending[sent] == result.next_token:
            confirmed = a + 1  # the target's own token is the next pending one: keep the pending tokens after it
            run.pending, run.dists = run.pending[sent + 1 :], run.dists[sent + 1 :]
        else:
            run.pending, run.dists = [], []
        run.verified.extend(new)
        run.accepted_lengths.append(a + 1)
        run.draft_lengths.append(sent)
        cache = run.cache
        tokens = torch.tensor([run.verified + run.pending], device=self.drafter.device)  # [1, T]
        keep = min(cache.common_prefix(tokens), tokens.shape[1] - 1)
        if keep < cache.get_seq_length():
            cache.truncate(keep)
        if result.context is not None:
            skip = cache.context_length - result.context_start  # >= 0 (`connection.check_answer`)
            if result.context.shape[0] > skip:
                context = result.context[skip:][None].to(self.drafter.device)  # [1, T, d]
                start, held = cache.context_length, result.context_valid_from  # positions < held have no context
                positions = torch.arange(start, start + context.shape[1], device=self.drafter.device)  # [T]
                self.drafter.extend_context(cache, context, valid=None if start >= held else positions >= held)
        generated = run.verified[len(run.prompt) :]
        first_new = len(generated) - len(new)
        stop = next((i for i, t in enumerate(new) if t in self._eos), None)  # stop at the first EOS
        if stop is not None or len(generated) >= run.max_new_tokens:
            keep_new = len(new) if stop is None else stop + 1
            keep_new = min(keep_new, run.max_new_tokens - first_new)
            del run.verified[len(run.prompt) + first_new + keep_new :]
            new, confirmed = new[:keep_new], min(confirmed, keep_new)
            run.pending, run.dists, run.done = [], [], True
        return new, confirmed

    def _finish(self, run: _Run, t_start: float) -> GenerationResult:
        generated = run.verified[len(run.prompt) :]
        tail = [] if run.done else run.pending[: max(0, run.max_new_tokens - len(generated))]
        tokens = generated + tail
        span = [len(generated), len(tokens)] if tail else None
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""
        total = time.perf_counter() - t_start
        calls = max(run.calls, 1)
        return GenerationResult(
            text=text,
            token_ids=tokens,
            prompt_ids=run.prompt,
            server_calls=run.calls,
            verified=not tail,
            unverified_tokens=len(tail),
            unverified_span=span,
            offline_spans=run.offline_spans,
            timings={
                "total_s": total,
                "first_token_s": run.first_token_s,
                "first_unverified_token_s": run.first_unverified_s,
                "per_token_ms": 1000 * total / max(len(tokens), 1),
                "network_s": run.network_s,
                "server_s": run.server_s,
                "draft_s": run.draft_s,
                "admission_wait_s": run.admission_wait_s,
            },
            stats={
                "failed_calls": run.failed_calls,
                "session_recreations": run.recreations,
                "busy_answers": run.busy_answers,
                "corrupted_answers": run.corrupted_answers,
                "drafted_tokens": run.drafted,
                "lookup_drafted_tokens": run.lookup_drafted,
                "mean_accepted_length": sum(run.accepted_lengths) / calls,
                "accepted_lengths": run.accepted_lengths,
                "draft_lengths": run.draft_lengths,
                "calls_per_token": run.calls / max(len(generated), 1),
                "bytes_up": run.bytes_up,
                "bytes_down": run.bytes_down,
                "acceptance_estimate": self.policy.acceptance,
                "drafter_revision": self.revision,
            },
        )
