"""The speculation policy's core: the one decision every route makes (the engine, vLLM's proposer, the serving
client), and the parts it is made of.

Terms: a *step* (a cycle, a call) verifies every row's proposal in one target forward; an *option* is what a step may
play: a draft length k (0: plain decoding), the n nodes a tree is cut to, an arm (a family of shapes). A *proposal*
is one row's drafted tokens of one step (by the drafter's network or by prompt lookup); its token j (0-based) is
*reached* when the tokens before it were right, *right* when the target accepted it.

The decision (`best`, `best_index`): play the option o of most expected tokens per second,

    E(o) / T(o)     E(o): the tokens a step playing o gains (the accepted drafts and each row's token from the
                    target); for a chain of k tokens right at rates a_1 .. a_k, E(k) = 1 + sum_{i<=k} a_1 ... a_i
                    per row. T(o): the step's seconds (verifying, drafting, whatever else the route pays).

E and T are modelled from the parts below or measured (seconds per token played); the first of equal options plays
(routes list the cheapest first: plain decoding). Each option is measured a few times before they are compared
(`unmeasured`); an option that is not the best is still played now and then (a *probe*: its rate drifts with the
context and the text), on one schedule (`ProbeSchedule`): due `base` x 2^(probes it lost in a row) steps after it
last played.

    PositionRates   the a_j: right / reached of token j, with a prior, per class of proposal length
    VerifyFit       T's verification: the cost table T(n) fitted to what the steps' verifications took
    interpolate     a cost table between its measured sizes

Each route is an adapter that prices E and T its own way and calls `best`: the engine (policy.py, `ShapePolicy`: arms
by measured seconds per token; tree.py's `cut_to_budget`: a tree's n nodes), vLLM's proposer (moa_hf/vllm/policy.py:
a step of B rows, with what only vLLM measures in moa_hf/vllm/pricing.py), the serving client
(moa_hf/serving/draft_policy.py: a round trip). This file ships inside every published drafter repo
(custom_generate/): it imports only torch and the standard library.
"""

import math

import torch

__all__ = ["PositionRates", "ProbeSchedule", "VerifyFit", "best", "best_index", "interpolate", "unmeasured"]


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


# ---------------------------------------------------------------------------------------------------------------------
# The decision: the most expected tokens per second, and the probes
# ---------------------------------------------------------------------------------------------------------------------
def best(options, tokens_per_second=None, *, seconds_per_token=None, default=None):
    """The option of most expected tokens per second E(o) / T(o): the largest `tokens_per_second(o)` (as modelled)
    or the smallest `seconds_per_token(o)` (as measured), None for an option not rated yet (skipped). The first of
    equals plays (list the cheapest first); `default` where no option is rated."""

    def rate(option):
        if seconds_per_token is None:
            return tokens_per_second(option)
        seconds = seconds_per_token(option)
        return None if seconds is None else -seconds  # fewer seconds first: negated, the same order exactly

    rated = [(o, r) for o in options if (r := rate(o)) is not None]
    return max(rated, key=lambda rated_option: rated_option[1])[0] if rated else default


def unmeasured(options, count, needed: int):
    """The first of `options` measured (`count(o)`) fewer than `needed` times, None where none is: every option is
    measured before `best` compares them."""
    return next((o for o in options if count(o) < needed), None)


def best_index(tokens: torch.Tensor, seconds: torch.Tensor) -> int:
    """`best` of the options 0 .. n-1 given as tensors: tokens [n] their E, seconds [n] their T."""
    return int((tokens / seconds).argmax())


class ProbeSchedule:
    """When an option that is not the best plays anyway (a *probe*, to measure it again). Option `key` is due once
    `now` - the step it last played >= `base` x 2^(probes it lost in a row) (that factor at most `most`; None: no
    limit): steps counted on the route's clock, `base` the route's interval for it. Of several due options the one
    played longest ago goes first. A probe the option loses (it is still not the best) doubles its interval, one it
    wins resets it. `losses` and `last` ({key: the step it last played}, 0 where absent): a schedule to go on from."""

    def __init__(self, most: float | None = None, losses: dict | None = None, last: dict | None = None):
        self.most = most
        self.losses: dict = dict(losses or {})
        self.last: dict = dict(last or {})

    def factor(self, key) -> float:
        factor = 2.0 ** self.losses.get(key, 0)
        return factor if self.most is None else min(factor, self.most)

    def interval(self, key, base: float) -> float:
        return base * self.factor(key)

    def due(self, key, now: int, base: float) -> bool:
        return now - self.last.get(key, 0) >= self.interval(key, base)

    def probe(self, bases: dict, now: int):
        """Of the options `bases` ({key: its base interval}), the due one played longest ago; None: none is due."""
        due = [key for key, base in bases.items() if self.due(key, now, base)]
        return min(due, key=lambda key: self.last.get(key, 0), default=None)

    def played(self, key, now: int) -> None:
        self.last[key] = now

    def lost(self, key) -> None:
        self.losses[key] = self.losses.get(key, 0) + 1

    def won(self, key) -> None:
        self.losses[key] = 0
