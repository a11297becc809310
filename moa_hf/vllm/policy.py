"""How many tokens to draft per row at vLLM's current batch size, from what the engine measures as it runs.

Terms: a *step* is one engine iteration (the target verifies every row's draft in one forward, then the proposer
drafts the next); the *draft length* k is the most tokens a row drafts for the next step (0: plain decoding, and
the drafter does no work). With a_i the share of drafts reaching position i that are accepted there, a row gains

    E(k) = 1 + sum_{i<=k} a_1 ... a_i                   tokens per step,

and a step of B rows at draft length k costs

    T(B (1 + k)) + D(B, k)                              seconds,

T(N) the engine's time for a step that verifies N tokens (everything outside the proposer: target forward,
sampling, scheduling) and D the proposer's own time. Both are measured as the engine runs: T by the tokens each
step verified, so a measurement at one batch size serves every other with the same N, and D per batch bucket and k.
The policy picks k maximising B E(k) / (T(B (1 + k)) + D(B, k)): where verifying k more tokens per row costs more
than they bring (large batches on a CPU), that is 0 and vLLM runs as it would alone.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

__all__ = ["DraftLengthPolicy", "batch_bucket"]


def batch_bucket(batch_size: int) -> int:
    """Batch sizes share draft-time measurements within powers of two: 1, 2, 4 (3-4), 8 (5-8), ..."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class DraftLengthPolicy:
    max_tokens: int  # vLLM's num_speculative_tokens
    fixed: int | None = None  # always draft this many (no measuring)
    samples: int = 2  # measurements of k = 0 and k = max at a batch bucket before choosing from the model
    window: int = 16  # newest measurements kept per key
    explore_every: int = 64  # steps between re-measuring k = max where the model chose less (acceptance drifts)
    explore_margin: float = 1.1  # measure drafting only where free drafting beats plain decoding by this factor
    reached: list[int] = field(default_factory=list)  # reached[i]: drafts that had a token at position i+1
    accepted: list[int] = field(default_factory=list)  # accepted[i]: ... whose token i+1 was accepted
    engine_times: dict = field(default_factory=dict)  # N verified tokens -> deque of engine seconds per step
    draft_times: dict = field(default_factory=dict)  # (bucket, k) -> deque of proposer seconds per step
    last_max: dict = field(default_factory=dict)  # bucket -> step of the latest k = max
    backoff: dict = field(default_factory=dict)  # bucket -> multiplier of explore_every
    steps: int = 0

    def __post_init__(self):
        if self.fixed is not None and not 0 <= self.fixed <= self.max_tokens:
            raise ValueError(f"draft_length={self.fixed} must lie in [0, num_speculative_tokens={self.max_tokens}].")
        self.reached = self.reached or [0] * self.max_tokens
        self.accepted = self.accepted or [0] * self.max_tokens

    # -- what was measured ------------------------------------------------------------------------------------------
    def record_acceptance(self, drafted: int, accepted: int) -> None:
        """One row's draft of `drafted` tokens of which the first `accepted` were accepted."""
        for i in range(min(drafted, accepted + 1)):
            self.reached[i] += 1
            self.accepted[i] += i < accepted

    def record_step(self, batch_size: int, k: int, tokens: int, engine_s: float, draft_s: float | None) -> None:
        """A step of `batch_size` rows at draft length k that verified `tokens` tokens: the engine took `engine_s`
        seconds, and the proposer `draft_s` to draft for it (None: not a steady-state draft, e.g. rows caught up
        from scratch, whose one-off cost is not a per-step one)."""
        self.engine_times.setdefault(tokens, deque(maxlen=self.window)).append(engine_s)
        if draft_s is not None:
            self.draft_times.setdefault((batch_bucket(batch_size), k), deque(maxlen=self.window)).append(draft_s)

    def acceptance_rates(self) -> list[float]:
        """a_i, the share of drafts reaching position i that were accepted there (a prior of 1/2 before data)."""
        return [(a + 1) / (r + 2) for a, r in zip(self.accepted, self.reached)]

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a row gains per step with draft length k."""
        total, p = 1.0, 1.0
        for a in self.acceptance_rates()[:k]:
            p *= a
            total += p
        return total

    # -- the cost model -----------------------------------------------------------------------------------------------
    def engine_seconds(self, tokens: int) -> float | None:
        """T(N): the median engine time of steps verifying N tokens; between measured N, linear; beyond the largest,
        proportional to N (pessimistic for drafting: real costs grow slower); None before any measurement."""
        known = sorted((n, statistics.median(t)) for n, t in self.engine_times.items() if t)
        if not known:
            return None
        for (n0, t0), (n1, t1) in zip(known, known[1:]):
            if n0 <= tokens <= n1:
                return t0 + (t1 - t0) * (tokens - n0) / (n1 - n0)
        if tokens < known[0][0]:
            return known[0][1]
        n, t = known[-1]
        return t * tokens / n

    def draft_seconds(self, batch_size: int, k: int) -> float | None:
        """D(B, k): the proposer's median time at this batch bucket and k; an unmeasured 0 < k < max from k = max's
        time (its catch-up is the same, drafting ~ k); None when k = max is unmeasured."""
        times = self.draft_times.get((batch_bucket(batch_size), k))
        if times and (k == 0 or len(times) >= self.samples):
            return statistics.median(times)
        if k == 0:
            return 0.0
        top = self.draft_times.get((batch_bucket(batch_size), self.max_tokens))
        if not top or len(top) < self.samples:
            return None
        return statistics.median(top) * (1 + k) / (1 + self.max_tokens)

    def throughput(self, batch_size: int, k: int, optimistic: bool = False) -> float | None:
        """Tokens per second the model predicts at draft length k (None: unmeasured); `optimistic`: with drafting
        free (what drafting could at best give)."""
        engine = self.engine_seconds(batch_size * (1 + k))
        draft = 0.0 if optimistic else self.draft_seconds(batch_size, k)
        if engine is None or draft is None:
            return None
        return batch_size * self.expected_tokens(k) / (engine + draft)

    # -- the choice ---------------------------------------------------------------------------------------------------
    def _measured(self, batch_size: int, k: int) -> int:
        return len(self.draft_times.get((batch_bucket(batch_size), k), ()))

    def choose(self, batch_size: int) -> int:
        """The draft length for the next step at `batch_size` rows.

        Drafting is measured (k = max, then 0, `samples` steps each) at a batch size only while the model says it
        could pay: with no engine time yet, or when even free drafting would beat plain decoding by
        `explore_margin` by the engine times measured so far (at any batch size with the same tokens per step);
        trying is not free, every row must first be caught up. Then the best k by the model; k = max is
        measured again after `explore_every` steps, an interval that doubles each time it loses."""
        self.steps += 1
        if self.fixed is not None:
            return self.fixed
        bucket = batch_bucket(batch_size)
        plain = self.throughput(batch_size, 0)
        ks = range(1, self.max_tokens + 1)
        best_free = max((self.throughput(batch_size, k, optimistic=True) or 0.0) for k in ks)
        could_pay = plain is None or best_free > self.explore_margin * plain  # trying costs rows' catch-up
        if could_pay:
            for k in (self.max_tokens, 0):  # measure both ends at this batch size
                if self._measured(batch_size, k) < self.samples:
                    return self._chose(bucket, k)
        scores = {k: self.throughput(batch_size, k) for k in range(self.max_tokens + 1)}
        best = max((k for k in scores if scores[k] is not None), key=lambda k: scores[k], default=0)
        interval = self.explore_every * self.backoff.get(bucket, 1)
        if could_pay and best < self.max_tokens and self.steps - self.last_max.get(bucket, 0) > interval:
            self.backoff[bucket] = 2 * self.backoff.get(bucket, 1)  # look again, later each time it loses
            return self._chose(bucket, self.max_tokens)
        if best == self.max_tokens:
            self.backoff[bucket] = 1
        return self._chose(bucket, best)

    def _chose(self, bucket: int, k: int) -> int:
        if k == self.max_tokens:
            self.last_max[bucket] = self.steps
        return k

    def as_dict(self) -> dict:
        return {
            "acceptance_by_position": [round(a, 4) for a in self.acceptance_rates()],
            "engine_s_by_tokens": {n: round(statistics.median(t), 5) for n, t in sorted(self.engine_times.items())},
            "draft_s": {f"batch<={b},k={k}": round(statistics.median(t), 5) for (b, k), t in self.draft_times.items()},
        }
