"""How many tokens to draft per row at vLLM's current batch size, from what the engine measures as it runs.

Terms: a *step* is one engine iteration (the target verifies every row's draft in one forward, then the proposer
drafts the next); *draft length* k is the most tokens a row drafts for the next step (0: plain decoding, and the
drafter does no work at all). With a_i the share of drafts reaching position i that are accepted there, a row
gains E(k) = 1 + sum_{i<=k} a_1 ... a_i tokens per step; a step of draft length k at batch size B takes T(B, k)
seconds, measured. The policy picks k maximising B * E(k) / T(B, k): at a batch size where verifying k more tokens
per row costs more than they bring, that is 0, and vLLM runs as it would alone.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

__all__ = ["DraftLengthPolicy", "batch_bucket"]


def batch_bucket(batch_size: int) -> int:
    """Batch sizes share measurements within powers of two: 1, 2, 4 (3-4), 8 (5-8), ..."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class DraftLengthPolicy:
    max_tokens: int  # vLLM's num_speculative_tokens
    fixed: int | None = None  # always draft this many (no measuring)
    samples: int = 3  # step times measured per (batch bucket, k) before trusting them
    window: int = 16  # newest step times kept per (batch bucket, k)
    explore_every: int = 50  # steps between re-measuring the least recently measured k
    reached: list[int] = field(default_factory=list)  # reached[i]: drafts that had a token at position i+1
    accepted: list[int] = field(default_factory=list)  # accepted[i]: ... whose token i+1 was accepted
    times: dict = field(default_factory=dict)  # (bucket, k) -> deque of step seconds
    last_measured: dict = field(default_factory=dict)  # (bucket, k) -> step counter
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

    def record_step(self, batch_size: int, k: int, seconds: float) -> None:
        """One step at `batch_size` rows whose drafts had at most k tokens took `seconds` (proposer to proposer)."""
        key = (batch_bucket(batch_size), k)
        self.times.setdefault(key, deque(maxlen=self.window)).append(seconds / batch_size)  # per row
        self.last_measured[key] = self.steps

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

    def step_seconds(self, batch_size: int, k: int) -> float | None:
        """Median measured seconds per row of a step of draft length k at this batch size, None when unmeasured."""
        times = self.times.get((batch_bucket(batch_size), k))
        return statistics.median(times) if times and len(times) >= self.samples else None

    # -- the choice ---------------------------------------------------------------------------------------------------
    def choose(self, batch_size: int) -> int:
        """The draft length for the next step at `batch_size` rows."""
        self.steps += 1
        if self.fixed is not None:
            return self.fixed
        bucket = batch_bucket(batch_size)
        candidates = range(self.max_tokens + 1)
        unmeasured = [k for k in (self.max_tokens, 0, *candidates) if self.step_seconds(batch_size, k) is None]
        if unmeasured:
            return unmeasured[0]
        stale = min(candidates, key=lambda k: self.last_measured.get((bucket, k), -1))
        if self.steps - self.last_measured.get((bucket, stale), -1) > self.explore_every:
            return stale
        return max(candidates, key=lambda k: self.expected_tokens(k) / self.step_seconds(batch_size, k))

    def as_dict(self) -> dict:
        return {
            "acceptance_by_position": [round(a, 4) for a in self.acceptance_rates()],
            "seconds_per_row": {
                f"batch<={b},k={k}": round(statistics.median(t), 6) for (b, k), t in sorted(self.times.items()) if t
            },
        }
