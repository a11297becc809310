"""Load control of `moa serve`: continuous batching of the target's work, and admission of new sessions.

- `Scheduler`: one thread owns the target. Handlers submit a `Job` per call (a session has at most one at a time) and
  await its future. Each tick takes the pending jobs (first come first served, up to `max_batch` rows): a verify
  feeds the session's uncached verified tokens and its drafts; a create feeds its prompt in chunks of at most
  `prefill_chunk` tokens, one chunk per tick, so a long prompt holds the other sessions up for one chunk at a time.
  The rows are grouped by length into as few target forwards as pay (`plan_forwards`: a 5-token verify padded to a
  256-token prefill chunk would cost 256 tokens of compute): normally every verify of a tick runs in one forward and
  the prefill chunks in another.
- `batched_forward`: one target forward over the rows, their caches stacked left-padded layer by layer as the
  forward reaches each layer (one layer's copy at a time), a 4-D mask per layer type (the engine's
  `tree_attention_mask`: ragged lengths, sliding windows), position ids per row; each row's new keys/values go into
  its session's cache through the cache's own `update`, so a sliding-window layer keeps what it would keep alone.
  Each session's acceptance then runs on its own logits: its output is what it gets alone (up to float rounding of
  the batched matrix products; tested token for token, greedy and seeded sampling).
- `Admission`: the sessions and their projected cache memory against the limits, with a FIFO of waiting creates.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..modeling import CACHE_NAME
from ..modeling.configuration_moa import target_layer_windows
from ..modeling.custom_generate.engine import tree_attention_mask
from .target_hidden import HiddenRecordingCache, record_hidden

__all__ = [
    "Admission",
    "AdmissionRefused",
    "ForwardRecord",
    "Job",
    "JobAbandoned",
    "Scheduler",
    "SchedulerClosed",
    "batched_forward",
    "plan_forwards",
]

logger = logging.getLogger(__name__)

# What one more target forward costs, in tokens of compute: rows are padded to one length where that costs less than
# another forward. Measured with SmolLM2-135M fp32 on this repository's 2-core CPU: a forward costs about 90-150 ms
# plus 4-6 ms per token (so ~20 tokens); on a GPU the fixed cost weighs more, which only favours merging.
FORWARD_OVERHEAD_TOKENS = 20


class SchedulerClosed(RuntimeError):
    """The scheduler stopped (the server is shutting down): the call did not run."""


class JobAbandoned(Exception):
    """The client of a job went away before it finished (its create is dropped, its prefill chunks skipped)."""


@dataclass(eq=False)
class Job:
    """One call's target work: feed `tokens` into `cache`; `finish(logits)` (scheduler thread) receives the float
    logits [keep, V] of the last `keep` tokens and returns the call's answer (the future's result). `prepare` runs in
    the scheduler thread before the first token is fed (e.g. a rollback of the cache)."""

    session_id: str
    cache: Any
    tokens: list[int]
    keep: int
    finish: Callable[[torch.Tensor | None], Any] | None
    prepare: Callable[[], None] | None = None
    future: Future = field(default_factory=Future)
    fed: int = 0
    started: bool = False
    abandoned: bool = False

    def abandon(self) -> None:
        """The client went away: drop the job (now if it has not started, else at the next tick or chunk)."""
        self.abandoned = True
        self.future.cancel()  # succeeds only while it waits: a running job is dropped by the scheduler


@dataclass(frozen=True)
class ForwardRecord:
    """One target forward of the scheduler: (session id, tokens fed, final chunk) per row, and its wall time."""

    rows: tuple[tuple[str, int, bool], ...]
    seconds: float


def plan_forwards(lengths: list[int], overhead_tokens: float = FORWARD_OVERHEAD_TOKENS) -> list[list[int]]:
    """Indices of `lengths` grouped into forwards, shortest rows first: rows sorted by length, split where padding
    the shorter rows to the longer ones would cost more than one more forward (`overhead_tokens`). Exact (dynamic
    programming over the sorted rows, cost of a group = overhead + rows x its longest length)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0.0] + [math.inf] * n  # best[j]: cost of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the last group is sorted rows i..j-1, padded to the longest, lengths[order[j-1]]
            cost = best[i] + overhead_tokens + (j - i) * lengths[order[j - 1]]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


# ---------------------------------------------------------------------------------------------------------------------
# One forward over several sessions' caches
# ---------------------------------------------------------------------------------------------------------------------
class _Layout:
    """What batching needs to know of a target: its layer types and their windows, and its attention's mask kind.
    `batchable` is False for targets the engine's masks do not cover (other layer types or attention kernels)."""

    def __init__(self, target):
        self.config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        impl = getattr(target.config, "_attn_implementation", "sdpa")
        self.additive = impl == "eager"
        try:
            self.windows = target_layer_windows(target.config)
            self.batchable = impl in ("sdpa", "eager")
        except ValueError:
            self.windows, self.batchable = {}, False
        types = getattr(self.config, "layer_types", None)
        n = self.config.num_hidden_layers
        self.kinds = list(types)[:n] if types is not None else [next(iter(self.windows), "full_attention")] * n
        self.dtype = target.dtype


def _forward_one(target, cache, tokens: list[int], keep: int) -> torch.Tensor | None:
    """A single row: the target over `tokens` on its own cache (no padding, no mask); logits [keep, V] or None (and
    a `HiddenRecordingCache` records the final hidden states of the tokens)."""
    device = target.device
    ids = torch.tensor([tokens], device=device)  # [1, q]
    hidden, start = isinstance(cache, HiddenRecordingCache), cache.get_seq_length()
    out = target(
        input_ids=ids, use_cache=True, logits_to_keep=max(1, keep), output_hidden_states=hidden, **{CACHE_NAME: cache}
    )
    record_hidden([cache], [start], [out.hidden_states[-1][0] if hidden else None])  # [q, D]
    return out.logits[0, -keep:].float() if keep else None  # [keep, V]


def _slots(cache, layer: int) -> tuple[int, int]:
    """(first position held, positions held) by one layer of a session's cache (a sliding-window layer holds the
    newest only, as `moa_hf.modeling.oldest_held_position` reads it)."""
    lay = cache.layers[layer] if layer < len(cache.layers) else None
    if lay is None or lay.keys is None or not lay.is_initialized or lay.keys.numel() == 0:
        return 0, 0
    held = lay.keys.shape[-2]
    return lay.get_seq_length() - held, held


def batched_forward(target, caches: list, inputs: list[list[int]], keep: list[int], layout: _Layout | None = None):
    """One target forward over several sessions: row b feeds `inputs[b]` on top of `caches[b]` (each a session's
    own `DynamicCache`, which receives the new keys/values); returns per row the float logits [keep[b], V] of its last
    `keep[b]` tokens, or None where keep[b] is 0. One row, or a target the masks do not cover: row by row."""
    layout = layout or _Layout(target)
    if len(caches) == 1 or not layout.batchable:
        return [_forward_one(target, c, x, k) for c, x, k in zip(caches, inputs, keep)]
    device = target.device
    B, Q = len(inputs), max(len(x) for x in inputs)
    lengths = torch.tensor([len(x) for x in inputs], device=device)  # [B]
    ids = torch.zeros(B, Q, dtype=torch.long, device=device)  # [B, Q] left-padded: each row's tokens end together
    for b, x in enumerate(inputs):
        ids[b, Q - len(x) :] = torch.tensor(x, device=device)
    start = torch.tensor([c.get_seq_length() for c in caches], device=device)  # [B] position of each first new token
    col = torch.arange(Q, device=device)  # [Q]
    real = col[None, :] >= (Q - lengths)[:, None]  # [B, Q] the real (not padding) new tokens
    q_pos = (start[:, None] + col[None, :] - (Q - lengths)[:, None]).clamp_min(0)  # [B, Q]
    causal = torch.ones(Q, Q, dtype=torch.bool, device=device).tril()  # [Q, Q]
    eye = torch.eye(Q, dtype=torch.bool, device=device)
    q_visible = (causal[None] & real[:, None, :]) | eye  # [B, Q, Q]: padding sees only itself (no empty softmax row)

    temp = DynamicCache()
    masks = {}
    for layer, kind in enumerate(layout.kinds):
        held = [_slots(c, layer) for c in caches]  # per row (first position, slots), before any row grows
        temp.layers.append(_StackedLayer(caches, layer, [s for _, s in held], [len(x) for x in inputs]))
        if kind not in masks:  # every layer of a kind holds the same positions: one mask per kind
            S = max(s for _, s in held)
            masks[kind] = _kind_mask(held, S, q_pos, q_visible, layout.windows.get(kind), layout, device)
    attention_mask = masks if len(masks) > 1 else next(iter(masks.values()))
    hidden = any(isinstance(c, HiddenRecordingCache) for c in caches)  # a drafter reads the final hidden states
    out = target(
        input_ids=ids,
        attention_mask=attention_mask,
        position_ids=q_pos,
        use_cache=True,
        logits_to_keep=max(1, max(keep)),
        output_hidden_states=hidden,
        **{CACHE_NAME: temp},
    )
    if hidden:  # row b's real tokens are its last len(x) columns: [len(x), D] each
        rows = [out.hidden_states[-1][b, Q - len(x) :] for b, x in enumerate(inputs)]
        record_hidden(caches, start.tolist(), rows)
    width = out.logits.shape[1]
    return [out.logits[b, width - k :].float() if k else None for b, k in enumerate(keep)]  # [k, V] per row


class _StackedLayer(DynamicLayer):
    """One layer of a batched forward's temporary cache. When the forward reaches the layer (`update`), the rows'
    cached states are stacked left-padded into one buffer [B, H, S+Q, D] with the Q new tokens' states, and each
    row's new states go into its session's cache (its own `update`). The buffer lives while that layer attends:
    one layer's copy of the sessions' states at a time, not the whole cache's."""

    def __init__(self, caches: list, layer: int, held: list[int], lengths: list[int]):
        super().__init__()
        self.caches, self.layer, self.held, self.lengths = caches, layer, held, lengths
        self.filled = max(held)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        B, H, Q, D = key_states.shape
        S = self.filled
        keys = key_states.new_empty(B, H, S + Q, D)  # [B, H, S+Q, D]: row b's slots are the last held[b] of S
        values = value_states.new_empty(B, H, S + Q, value_states.shape[-1])
        for b, (cache, s, q) in enumerate(zip(self.caches, self.held, self.lengths)):
            keys[b, :, : S - s].zero_()  # padding: never attended, but finite (0 x NaN would be NaN)
            values[b, :, : S - s].zero_()
            if s:
                keys[b, :, S - s : S] = cache.layers[self.layer].keys[0]
                values[b, :, S - s : S] = cache.layers[self.layer].values[0]
            cache.update(key_states[b : b + 1, :, Q - q :], value_states[b : b + 1, :, Q - q :], self.layer)
        keys[:, :, S:] = key_states
        values[:, :, S:] = value_states
        self.filled = S + Q
        return keys, values

    def get_seq_length(self) -> int:
        return self.filled


def _kind_mask(held, S: int, q_pos, q_visible, window, layout: _Layout, device) -> torch.Tensor:
    """The [B, 1, Q, S+Q] mask of one layer type: left-padded slots (row b's last s_b hold positions first_b...)."""
    first = torch.tensor([f for f, _ in held], device=device)  # [B]
    count = torch.tensor([s for _, s in held], device=device)  # [B]
    slot = torch.arange(S, device=device)  # [S]
    slot_valid = slot[None, :] >= (S - count)[:, None]  # [B, S]
    slot_pos = (first[:, None] + slot[None, :] - (S - count)[:, None]).clamp_min(0)  # [B, S]
    mask = tree_attention_mask(slot_valid, slot_pos, q_pos, q_visible, window)  # [B, 1, Q, S+Q]
    if layout.additive:
        blocked = torch.finfo(layout.dtype).min
        mask = torch.zeros(mask.shape, dtype=layout.dtype, device=device).masked_fill(~mask, blocked)
    return mask


# ---------------------------------------------------------------------------------------------------------------------
# The scheduler thread
# ---------------------------------------------------------------------------------------------------------------------
class Scheduler:
    """The one thread that runs the target (see the module doc). `submit(job)` returns the job's future; the thread
    starts with the first job and ends with `close()` (or when the scheduler is garbage). `on_idle` is called from
    the thread about every `idle_every_s` (the server's reaping). `forward` (default `batched_forward`) may be
    replaced, e.g. by a slow one in tests. `history` holds the latest forwards (`ForwardRecord`)."""

    def __init__(
        self,
        target,
        max_batch: int = 32,
        prefill_chunk: int = 256,
        on_idle: Callable[[], None] | None = None,
        idle_every_s: float = 1.0,
        overhead_tokens: float = FORWARD_OVERHEAD_TOKENS,
        history: int = 1024,
    ):
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError(f"max_batch ({max_batch}) and prefill_chunk ({prefill_chunk}) must be >= 1")
        self.target, self.max_batch, self.prefill_chunk = target, max_batch, prefill_chunk
        self.on_idle, self.idle_every_s, self.overhead_tokens = on_idle, idle_every_s, overhead_tokens
        self.layout = _Layout(target)
        self.forward: Callable = batched_forward
        self.history: deque[ForwardRecord] = deque(maxlen=history)
        self.active_batch = 0  # rows of the tick now running (0: idle)
        self._pending: list[Job] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._last_idle = 0.0

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished (running ones included)."""
        return len(self._pending)

    def submit(self, job: Job) -> Future:
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the server is shutting down")
            self._pending.append(job)
            self._cond.notify()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=Scheduler._run, args=(weakref.ref(self),), daemon=True, name="moa-serve-scheduler"
                )
                self._thread.start()
        return job.future

    def start(self) -> None:
        """Start the thread now (it otherwise starts with the first job), e.g. so that reaping runs from the start."""
        with self._cond:
            if not self._closed and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(
                    target=Scheduler._run, args=(weakref.ref(self),), daemon=True, name="moa-serve-scheduler"
                )
                self._thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread after its current tick; jobs still pending fail with `SchedulerClosed`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread, pending, self._pending = self._thread, self._pending, []
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        for job in pending:
            _fail(job, SchedulerClosed("the server shut down before this call ran"))

    @staticmethod
    def _run(ref: weakref.ref) -> None:
        """The thread: holds the scheduler only while it works, so a dropped server's thread ends by itself."""
        while True:
            self = ref()
            if self is None or not self._step():
                return
            del self

    def _step(self) -> bool:
        with self._cond:
            if not self._pending and not self._closed:
                self._cond.wait(self.idle_every_s)
            if self._closed:
                return False
            jobs, dropped = self._take()
        for job in dropped:  # outside the lock: their done-callbacks take the server's locks
            _fail(job, JobAbandoned("the client went away"))
        now = time.monotonic()
        if self.on_idle is not None and now - self._last_idle >= self.idle_every_s:
            self._last_idle = now
            try:
                self.on_idle()
            except Exception:  # reaping must never stop the scheduler
                logger.exception("the scheduler's idle task failed")
        if jobs:
            self.tick(jobs)
        return True

    def _take(self) -> tuple[list[Job], list[Job]]:
        """(the jobs of the next tick: the oldest first, up to `max_batch`; the cancelled and abandoned ones, now
        out of the queue). Called with `_cond` held."""
        jobs, dropped = [], []
        for job in list(self._pending):
            if len(jobs) == self.max_batch:
                break
            if not job.started and not job.abandoned and not job.future.set_running_or_notify_cancel():
                job.abandoned = True  # cancelled while it waited (its done-callbacks ran then)
            if job.abandoned:
                self._pending.remove(job)
                dropped.append(job)
                continue
            job.started = True
            jobs.append(job)
        return jobs, dropped

    def tick(self, jobs: list[Job]) -> None:
        """One round: one chunk of every job, in as few forwards as pay (`plan_forwards`)."""
        rows = []
        for job in jobs:
            if job.fed == 0 and job.prepare is not None:
                try:
                    job.prepare()
                except Exception as err:
                    self._done(job, err)
                    continue
                job.prepare = None
            rows.append((job, min(len(job.tokens) - job.fed, self.prefill_chunk)))
        self.active_batch = len(rows)
        try:
            for group in plan_forwards([n for _, n in rows], self.overhead_tokens):
                self._forward([rows[i] for i in group])
        finally:
            self.active_batch = 0

    def _forward(self, rows: list[tuple[Job, int]]) -> None:
        finals = [job.fed + n == len(job.tokens) for job, n in rows]
        inputs = [job.tokens[job.fed : job.fed + n] for job, n in rows]
        keep = [job.keep if final else 0 for (job, _), final in zip(rows, finals)]
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                logits = self.forward(self.target, [job.cache for job, _ in rows], inputs, keep, self.layout)
        except Exception as err:  # every row's cache may be half-updated: its session is dropped by the server
            logger.exception("a target forward of %d rows failed", len(rows))
            for job, _ in rows:
                self._done(job, err)
            return
        seconds = time.perf_counter() - t0
        self.history.append(ForwardRecord(tuple((j.session_id, n, f) for (j, n), f in zip(rows, finals)), seconds))
        for (job, n), final, row_logits in zip(rows, finals, logits):
            job.fed += n
            if not final:
                continue
            try:
                with torch.no_grad():
                    result = job.finish(row_logits)
            except Exception as err:
                self._done(job, err)
            else:
                self._done(job, None, result)

    def _done(self, job: Job, error: BaseException | None, result: Any = None) -> None:
        with self._cond:
            if job in self._pending:
                self._pending.remove(job)
        if error is not None:
            _fail(job, error)
        else:
            try:
                job.future.set_result(result)
            except InvalidStateError:  # cancelled meanwhile
                pass


def _fail(job: Job, error: BaseException) -> None:
    try:
        job.future.set_exception(error)
    except InvalidStateError:  # cancelled (its done-callbacks already ran) or already answered
        pass


# ---------------------------------------------------------------------------------------------------------------------
# Admission
# ---------------------------------------------------------------------------------------------------------------------
class AdmissionRefused(Exception):
    """No session for now: `status` 429 (full) or 503 (shutting down), retry after `retry_after_s`."""

    def __init__(self, detail: str, retry_after_s: int, queue_depth: int, status: int = 429):
        super().__init__(detail)
        self.detail, self.retry_after_s, self.queue_depth, self.status = detail, retry_after_s, queue_depth, status


@dataclass(eq=False)
class _Waiter:
    cost: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    granted: bool = False


class Admission:
    """New sessions against `max_sessions` and `budget_bytes` of projected cache memory, with a FIFO queue of creates
    waiting for room (async: a waiting create holds no thread). What is in use is the registered sessions, read
    from `usage()` -> (sessions, bytes) (the server's session table), plus the reservations of creates still
    running. Thread-safe: `settle` and `wake` may be called from any thread."""

    def __init__(
        self,
        max_sessions: int,
        budget_bytes: int,
        max_queue: int,
        wait_s: float,
        usage: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ):
        self.max_sessions, self.budget_bytes, self.max_queue, self.wait_s = (
            max_sessions,
            budget_bytes,
            max_queue,
            wait_s,
        )
        self.usage = usage
        self.draining = False
        self._pending, self._pending_bytes = 0, 0  # creates admitted and not yet settled
        self._queue: deque[_Waiter] = deque()
        self._lock = threading.Lock()
        self._lifetimes: deque[float] = deque(maxlen=32)  # seconds sessions were held, for Retry-After

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def sessions(self) -> int:
        return self.usage()[0] + self._pending

    @property
    def used_bytes(self) -> int:
        return self.usage()[1] + self._pending_bytes

    def _fits(self, cost: int) -> bool:
        sessions, used = self.usage()
        sessions, used = sessions + self._pending, used + self._pending_bytes
        return sessions < self.max_sessions and used + cost <= self.budget_bytes

    def _take(self, cost: int) -> None:
        self._pending += 1
        self._pending_bytes += cost

    async def acquire(self, cost: int) -> None:
        """Reserve a session of `cost` bytes, waiting up to `wait_s` in the FIFO; `AdmissionRefused` otherwise. The
        caller then calls `settle(cost)` once (its session registered, or failed)."""
        if cost > self.budget_bytes:
            raise ValueError(
                f"this session's projected cache ({cost / 2**20:.0f} MiB) exceeds the server's whole memory budget "
                f"({self.budget_bytes / 2**20:.0f} MiB, --memory-budget-gb): ask for fewer max_new_tokens or a "
                "shorter prompt"
            )
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.draining:
                raise self._refusal("the server is shutting down", status=503)
            if not self._queue and self._fits(cost):
                self._take(cost)
                return
            if len(self._queue) >= self.max_queue:
                raise self._refusal(f"{len(self._queue)} sessions already wait for admission (--max-queue)")
            waiter = _Waiter(cost, loop, loop.create_future())
            self._queue.append(waiter)
        try:
            granted = await asyncio.wait_for(asyncio.shield(waiter.future), self.wait_s)
        except BaseException as err:  # timed out, or the handler was cancelled
            with self._lock:
                if waiter.granted:  # granted at the same moment: give it back
                    self._pending -= 1
                    self._pending_bytes -= cost
                    self._grant()
                elif waiter in self._queue:
                    self._queue.remove(waiter)
            if isinstance(err, TimeoutError):
                if self.draining:
                    raise self._refusal("the server is shutting down", status=503) from None
                raise self._refusal(self._full_detail(cost)) from None
            raise
        if not granted:
            raise self._refusal("the server is shutting down", status=503)

    def settle(self, cost: int) -> None:
        """A reservation of `acquire` ends: its session is registered (and counted by `usage`) or failed."""
        with self._lock:
            self._pending -= 1
            self._pending_bytes -= cost
            self._grant()

    def wake(self, held_s: float | None = None) -> None:
        """A session ended (after `held_s` seconds): admit the waiting creates that now fit (FIFO)."""
        with self._lock:
            if held_s is not None:
                self._lifetimes.append(held_s)
            self._grant()

    def drain(self) -> None:
        """Shutting down: refuse new sessions (503) and wake the waiting ones."""
        with self._lock:
            self.draining = True
            waiting, self._queue = list(self._queue), deque()
        for waiter in waiting:
            waiter.loop.call_soon_threadsafe(_settle, waiter.future, False)

    def _grant(self) -> None:
        while self._queue and self._fits(self._queue[0].cost):
            waiter = self._queue.popleft()
            self._take(waiter.cost)
            waiter.granted = True
            waiter.loop.call_soon_threadsafe(_settle, waiter.future, True)

    def _full_detail(self, cost: int) -> str:
        sessions, used = self.sessions, self.used_bytes
        if sessions >= self.max_sessions:
            return (
                f"this server already runs {sessions} sessions (--max-sessions {self.max_sessions}); "
                "retry after Retry-After seconds"
            )
        return (
            f"this server's session memory is full ({used / 2**20:.0f} of {self.budget_bytes / 2**20:.0f} MiB "
            f"reserved, this session needs {cost / 2**20:.0f} MiB; --memory-budget-gb); retry after Retry-After "
            "seconds"
        )

    def retry_after_s(self) -> int:
        """Seconds until a slot is likely free: the mean session lifetime seen lately, scaled by the queue ahead per
        slot (1 to 60 s; 2 s before any session ended)."""
        mean = sum(self._lifetimes) / len(self._lifetimes) if self._lifetimes else 2.0
        ahead = (len(self._queue) + 1) / max(1, self.max_sessions)
        return int(min(60, max(1, math.ceil(mean * min(1.0, ahead)))))

    def _refusal(self, detail: str, status: int = 429) -> AdmissionRefused:
        return AdmissionRefused(detail, self.retry_after_s(), len(self._queue), status=status)


def _settle(future: asyncio.Future, granted: bool) -> None:
    if not future.done():
        future.set_result(granted)
