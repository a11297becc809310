"""The speculation policy's core: what every route (the engine, vLLM's proposer, the serving client) measures and
prices to decide "plain decoding, lookup only, or the network, and how far ahead".

Terms: a *proposal* is one row's drafted tokens of one step (by the drafter's network or by prompt lookup); its
token j (0-based) is *reached* when tokens < j were right, *right* when the target accepted it. A *step* (a cycle,
a call) verifies every row's proposal in one target forward of n tokens per row.

    PositionRates   acceptance by draft position, per arm and per class of proposal length: right / reached of
                    token j, with a prior; E(k) = 1 + sum_{i<=k} a_1 ... a_i tokens per step
    VerifyFit       the verification cost table T(n) and its fit to what steps took: base x T(1) + extra x
                    (T(n) - T(1)), decayed least squares (a longer context makes further tokens dearer)
    MeasuredCosts   seconds by key (tokens verified, or a batch bucket and draft length), the median of the latest
                    measurements, interpolated between sizes
    Backoff         the probe schedule: an option that is not the best is probed again after its base interval x
                    2^(probes it lost in a row), at most `most` x
    CatchUpPrice    the one-off cost of reading a row's verified tokens into the drafter (C seconds per token,
                    measured), spread over the steps the row has left: C n E / R per step for R tokens left
    OutputLengths   R, from how many tokens the rows seen to finish generated
    batch_bucket    batch sizes share measurements within powers of two

The routes are adapters over these parts, each saying what differs: the engine (policy.py, `ShapePolicy`) plays arms
of tree shapes on measured seconds per token; vLLM's proposer (moa_hf/vllm/policy.py) prices a step of B rows and a
row's remaining tokens; the client (moa_hf/serving/draft_policy.py) prices a round trip. This file ships inside
every published drafter repo (custom_generate/): it imports only torch and the standard library.
"""

import math
import statistics
from collections import deque

import torch

__all__ = [
    "Backoff",
    "CatchUpPrice",
    "MeasuredCosts",
    "OutputLengths",
    "PositionRates",
    "VerifyFit",
    "batch_bucket",
    "interpolate",
    "LOOKUP_CLASSES",
]

LOOKUP_CLASSES = 5  # lookup proposals of 1, 2-3, 4-7, 8-15, 16+ tokens keep right rates apart (`PositionRates`)


def batch_bucket(batch_size: int) -> int:
    """Batch sizes share measurements within powers of two: 1, 2, 4 (3-4), 8 (5-8), ..."""
    return 1 << max(0, batch_size - 1).bit_length()


def interpolate(points: list, n: float, beyond: str = "linear") -> float:
    """The seconds at size n from sorted (size, seconds) `points`: linear between them, the first's below, and above
    the largest "linear" (the last segment's slope) or "proportional" (seconds / size: pessimistic for drafting,
    real costs grow slower)."""
    if n <= points[0][0]:
        return points[0][1]
    for (a, ta), (b, tb) in zip(points, points[1:]):
        if n <= b:
            return ta + (tb - ta) * (n - a) / (b - a)
    b, tb = points[-1]
    if beyond == "proportional" or len(points) == 1:
        return tb * n / b
    a, ta = points[-2]
    return tb + (tb - ta) * (n - b) / (b - a)


class PositionRates:
    """Acceptance by draft position, kept per class of proposal length: `right[c][j] / tried[c][j]`, token j (0-based)
    of proposals of class c, counted where the tokens before it were right. Classes (`length_class`): proposals of
    1, 2-3, 4-7, ... tokens (a longer lookup proposal followed a longer matched n-gram, and is right more often);
    one class pools every length. Positions past the table share its last entry. `prior`: (right, tried) of the
    first position and of the others; `decay`: the weight of earlier proposals per newer one (1: none); `bounds`:
    the rates are clipped to them (a log of 0 would make a proposal worthless for good)."""

    def __init__(
        self,
        positions: int,
        classes: int = 1,
        prior: tuple = ((1.0, 2.0), (1.0, 2.0)),
        decay: float = 1.0,
        bounds: tuple = (0.0, 1.0),
    ):
        if positions < 1 or classes < 1:
            raise ValueError(f"PositionRates needs at least one position and one class, got {positions}, {classes}.")
        (r0, t0), (r1, t1) = prior
        self.right = [[r0] + [r1] * (positions - 1) for _ in range(classes)]
        self.tried = [[t0] + [t1] * (positions - 1) for _ in range(classes)]
        self.decay, self.bounds = decay, bounds

    def length_class(self, length: int | None) -> int:
        """The class of a proposal of `length` tokens: floor(log2(length)), at most the last (None: the first)."""
        return min(len(self.right) - 1, max(0, (length or 1).bit_length() - 1))

    def record(self, drafted: int, accepted: int, length: int | None = None) -> None:
        """A proposal of `length` tokens (default `drafted`) of which `drafted` were verified and the first
        `accepted` right: tokens up to the first wrong one were reached."""
        c = self.length_class(length or drafted)
        right, tried = self.right[c], self.tried[c]
        if self.decay != 1.0 and drafted > 0:
            right[:] = [self.decay * r for r in right]
            tried[:] = [self.decay * t for t in tried]
        last = len(tried) - 1
        for j in range(min(drafted, accepted + 1)):
            tried[min(j, last)] += 1
            right[min(j, last)] += j < accepted

    def rates(self, n: int, length: int | None = None) -> list[float]:
        """a_1 .. a_n: the rate of each of a proposal's first n positions (class of `length`, default n)."""
        c = self.length_class(length or n)
        right, tried = self.right[c], self.tried[c]
        lo, hi = self.bounds
        return [min(hi, max(lo, right[min(j, len(right) - 1)] / tried[min(j, len(tried) - 1)])) for j in range(n)]

    def log_probs(self, n: int, length: int | None = None) -> list[float]:
        """log P(the first j tokens are all right), j = 1..n."""
        out, total = [], 0.0
        for a in self.rates(n, length):
            total += math.log(a)
            out.append(total)
        return out

    def expected_tokens(self, k: int, length: int | None = None) -> float:
        """E(k) = 1 + sum_{i<=k} a_1 ... a_i: tokens a row gains per step proposing k (the target's own included)."""
        total, p = 1.0, 1.0
        for a in self.rates(k, length):
            p *= a
            total += p
        return total

    def state(self) -> list:
        """[(right, tried) per class]: what a later policy may start from (`load`)."""
        return [(list(r), list(t)) for r, t in zip(self.right, self.tried)]

    def load(self, state: list, max_tries: float) -> None:
        """Start from an earlier `state`, each position weighted as at most `max_tries` tries (a prior that this
        run's proposals soon outweigh)."""
        for c, (rights, trieds) in enumerate(state):
            for j, (right, tried) in enumerate(zip(rights, trieds)):
                if c < len(self.tried) and j < len(self.tried[c]) and tried > 0:
                    w = min(1.0, max_tries / tried)
                    self.right[c][j], self.tried[c][j] = w * right, w * tried

    def table(self, positions: int = 8) -> list[list[float]]:
        """Per class, the first `positions` measured rates (rounded), for logs."""
        return [[round(r / t, 3) for r, t in zip(rs[:positions], ts[:positions])] for rs, ts in self.state()]


class VerifyFit:
    """What verifying n tokens per row takes now: `base` x T(1) + `extra` x (T(n) - T(1)), T the cost table (a
    function of n: measured, or a prior line), the two factors fitted to what the steps' verifications took (least
    squares, the older steps decayed, a prior of `PRIOR` steps at 1 and 1, clipped to `bounds`). One factor for the
    whole table cannot follow a longer context: attending over it raises each more token's cost faster than the
    first's (at 1000 tokens of context verifying 12 cost 1.7 one-token steps here, against 1.25 at 100)."""

    DECAY = 0.95
    PRIOR = 2.0

    def __init__(self, table, bounds: tuple = ((0.25, 8.0), (0.1, 16.0))):
        self.table, self.bounds = table, bounds
        one, more = table(1), max(table(8) - table(1), 1e-9)
        w = self.PRIOR
        # decayed normal equations of time ~ base x one + extra x (table(n) - one), with the prior's rows in them
        self.xx = [w * one * one, 0.0, w * more * more]  # sum x1^2, x1 x2, x2^2
        self.xy = [w * one * one, w * more * more]  # sum x1 y, x2 y
        self.base, self.extra = 1.0, 1.0
        self._tables: dict[int, torch.Tensor] = {}

    def seconds_of(self, n: int) -> float:
        """The fitted seconds of verifying n tokens per row."""
        one = self.table(1)
        return self.base * one + self.extra * (self.table(n) - one)

    def seconds(self, limit: int) -> torch.Tensor:
        """[limit]: the fitted seconds of verifying n = 1..limit tokens per row."""
        if limit not in self._tables:
            self._tables[limit] = torch.tensor([self.table(n) for n in range(1, limit + 1)])
        table = self._tables[limit]
        return self.base * table[0] + self.extra * (table - table[0])

    def update(self, n: int, seconds: float) -> None:
        """A verification of n tokens per row took `seconds`."""
        x1 = self.table(1)
        x2 = self.table(n) - x1
        d = self.DECAY
        self.xx = [d * self.xx[0] + x1 * x1, d * self.xx[1] + x1 * x2, d * self.xx[2] + x2 * x2]
        self.xy = [d * self.xy[0] + x1 * seconds, d * self.xy[1] + x2 * seconds]
        (a, b, c), (u, v) = self.xx, self.xy
        (lo, hi), (lo2, hi2) = self.bounds
        det = a * c - b * b
        if det <= 1e-12 * a * c:  # only one size verified lately: scale both alike
            self.base = self.extra = min(hi, max(lo, u / max(a, 1e-12)))
            return
        self.base = min(hi, max(lo, (c * u - b * v) / det))
        self.extra = min(hi2, max(lo2, (a * v - b * u) / det))


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


class Backoff:
    """The probe schedule of options that are not the best: option `key` is probed again after its base interval x
    2^(probes it lost in a row), at most `most` x (None: no limit); a probe it wins resets it."""

    def __init__(self, most: float | None = None, losses: dict | None = None):
        self.most = most
        self.losses: dict = dict(losses or {})

    def factor(self, key) -> float:
        factor = 2.0 ** self.losses.get(key, 0)
        return factor if self.most is None else min(factor, self.most)

    def interval(self, key, base: float) -> float:
        return base * self.factor(key)

    def lost(self, key) -> None:
        self.losses[key] = self.losses.get(key, 0) + 1

    def won(self, key) -> None:
        self.losses[key] = 0


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
