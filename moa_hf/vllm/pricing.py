"""What only vLLM's draft policy (`VllmDraftPolicy`, policy.py) measures to price a step: its costs by key
(`MeasuredCosts`), batch sizes sharing them (`batch_bucket`), a row's one-off catch-up (`CatchUpPrice`: C seconds per
token read into the drafter, spread over the steps the row has left, C n E / R per step for R tokens left) and those
tokens left (`OutputLengths`, from the rows seen to finish: vLLM does not tell a proposer its requests'
`max_tokens`). The decision they feed is the policy core's (modeling/custom_generate/policy_core.py).
"""

from __future__ import annotations

import statistics
from collections import deque

from ..modeling.custom_generate.policy_core import interpolate

__all__ = ["CatchUpPrice", "MeasuredCosts", "OutputLengths", "batch_bucket"]


def batch_bucket(batch_size: int) -> int:
    """Batch sizes share measurements within powers of two: 1, 2, 4 (3-4), 8 (5-8), ..."""
    return 1 << max(0, batch_size - 1).bit_length()


class MeasuredCosts:
    """Seconds by key: the median of each key's latest `window` measurements; an integer key (tokens verified) is
    interpolated between the measured ones (`interpolate`)."""

    def __init__(self, window: int = 16):
        self.window = window
        self.times: dict = {}  # key -> deque of seconds

    def add(self, key, seconds: float) -> None:
        self.times.setdefault(key, deque(maxlen=self.window)).append(seconds)

    def count(self, key) -> int:
        return len(self.times.get(key, ()))

    def median(self, key) -> float | None:
        times = self.times.get(key)
        return statistics.median(times) if times else None

    def at(self, n: int, beyond: str = "proportional") -> float | None:
        """The seconds at size n between the measured sizes (None before any measurement)."""
        points = sorted((k, statistics.median(t)) for k, t in self.times.items() if t)
        return interpolate(points, n, beyond) if points else None

    def as_dict(self) -> list[tuple]:
        """[(key, median seconds)], for logs."""
        return [(k, round(statistics.median(t), 5)) for k, t in sorted(self.times.items()) if t]


class OutputLengths:
    """How many tokens requests generate, from the rows seen to finish: how many a running row has left."""

    def __init__(self, prior: float = 64.0, keep: int = 256):
        self.prior = prior  # tokens left assumed before any row finished (or for a row past every length seen)
        self.finished: deque = deque(maxlen=keep)  # generated tokens of the latest finished rows

    def record(self, generated: int) -> None:
        self.finished.append(generated)

    def remaining(self, generated: int) -> float:
        """Expected tokens still to come for a row that generated `generated`: the mean excess of the finished rows
        that generated more."""
        longer = [n - generated for n in self.finished if n > generated]
        return sum(longer) / len(longer) if longer else self.prior

    def mean(self) -> float | None:
        return round(statistics.mean(self.finished), 1) if self.finished else None


class CatchUpPrice:
    """The drafter's one-off catch-up (reading a row's verified tokens before it drafts for it): C seconds per token,
    the median of the latest `window` catch-ups, spread over the steps the row has left."""

    def __init__(self, window: int = 32):
        self.per_token: deque = deque(maxlen=window)

    def record(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.per_token.append(seconds / tokens)

    def seconds(self, tokens: int) -> float:
        """C n: the time to catch `tokens` tokens up (0 before the first catch-up is measured)."""
        return statistics.median(self.per_token) * tokens if self.per_token and tokens else 0.0

    def per_step(self, tokens: int, remaining: float, gained: float) -> float:
        """C n E / R: the catch-up of `tokens` spread over the steps (of `gained` tokens) of `remaining` tokens."""
        return self.seconds(tokens) / max(1.0, remaining / gained) if tokens else 0.0
