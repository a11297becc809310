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

With the drafter's prompt lookup on, a share p of the rows have a lookup proposal (a copy, at no forward's cost) and
the rest need the network; a step either runs the network for them or leaves them undrafted (*lookup only*). Both
sources keep their own acceptance, so a row gains p E_lookup(k) + (1 - p) E_network(k) with the network and
p E_lookup(k) + (1 - p) without, the step verifying B (1 + k) or B (1 + p k) tokens, and D is measured for each: the
network runs only where what it adds pays for its time.

Before the network drafts for a row it has not followed (a new request, or one it stopped following while it did
not draft), it reads the row's verified tokens once (*catch-up*, C seconds per token, measured). That one-off cost
is spread over the steps the row has left, R / E tokens, R estimated from how many tokens the requests seen to
finish generated (`OutputLengths`; vLLM does not tell a proposer its requests' `max_tokens`): a step that needs n
tokens caught up pays C n E / R more. Where few steps are left (the tail of a batch whose long rows are still
running), the catch-up of a long prompt does not pay and the network stays off.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

import numpy as np

__all__ = ["DraftLengthPolicy", "OutputLengths", "RowLives", "batch_bucket", "pair_rows"]


def batch_bucket(batch_size: int) -> int:
    """Batch sizes share draft-time measurements within powers of two: 1, 2, 4 (3-4), 8 (5-8), ..."""
    return 1 << max(0, batch_size - 1).bit_length()


def pair_rows(states: list, histories: list, continues) -> list[int | None]:
    """For each row's verified tokens `histories[b]` (vLLM's row order), the index of the state that it continues
    (`continues(state, history)`), the state at the same position tried first, each state paired once; None: none.
    vLLM's rows move, join and leave between steps, so what the proposer keeps per row is found again this way."""
    taken: set[int] = set()
    pairs: list[int | None] = []
    for b, history in enumerate(histories):
        order = ([b] if b < len(states) else []) + [i for i in range(len(states)) if i != b]
        found = next((i for i in order if i not in taken and continues(states[i], history)), None)
        if found is not None:
            taken.add(found)
        pairs.append(found)
    return pairs


@dataclass
class OutputLengths:
    """How many tokens requests generate, from the rows seen to finish: how many a running row has left."""

    prior: float = 64.0  # tokens left assumed before any row finished (or for a row past every length seen)
    finished: deque = field(default_factory=lambda: deque(maxlen=256))  # generated tokens of the latest finished rows

    def record(self, generated: int) -> None:
        self.finished.append(generated)

    def remaining(self, generated: int) -> float:
        """Expected tokens still to come for a row that generated `generated`: the mean excess of the finished rows
        that generated more."""
        longer = [n - generated for n in self.finished if n > generated]
        return sum(longer) / len(longer) if longer else self.prior


class RowLives:
    """Follows vLLM's rows from step to step (rows move, join and leave) by the tokens each was first seen with, and
    counts what each generated; a row no longer seen has finished and its length goes to `lengths`."""

    def __init__(self, lengths: OutputLengths, signature: int = 16):
        self.lengths, self.signature = lengths, signature
        self.lives: list[tuple[int, np.ndarray, int]] = []  # (length first seen, its last tokens, length last seen)

    def update(self, histories: list) -> list[int]:
        """Each row's generated tokens so far (`histories[b]`: its verified tokens this step)."""
        pairs = pair_rows(self.lives, histories, self._continues)
        lives = []
        for history, found in zip(histories, pairs):
            if found is None:
                born = len(history)
                lives.append((born, np.array(history[max(0, born - self.signature) : born]), born))
            else:
                born, tail, _ = self.lives[found]
                lives.append((born, tail, len(history)))
        for i in sorted(set(range(len(self.lives))) - set(pairs)):  # rows no longer seen: finished
            born, _, last = self.lives[i]
            self.lengths.record(last - born + 1)
        self.lives = lives
        return [len(history) - born + 1 for history, (born, _, _) in zip(histories, lives)]

    @staticmethod
    def _continues(life: tuple, history) -> bool:
        born, tail, last = life
        return len(history) >= last and np.array_equal(history[born - len(tail) : born], tail)


@dataclass
class DraftLengthPolicy:
    max_tokens: int  # vLLM's num_speculative_tokens
    fixed: int | None = None  # always draft this many (no measuring)
    samples: int = 2  # measurements of k = 0 and k = max at a batch bucket before choosing from the model
    window: int = 16  # newest measurements kept per key
    explore_every: int = 64  # steps between re-measuring k = max where the model chose less (acceptance drifts)
    explore_margin: float = 1.1  # measure drafting only where free drafting beats plain decoding by this factor
    lookup: bool = False  # rows may draft by prompt lookup: also weigh steps that draft by lookup only
    reached: list[int] = field(default_factory=list)  # reached[i]: network drafts that had a token at position i+1
    accepted: list[int] = field(default_factory=list)  # accepted[i]: ... whose token i+1 was accepted
    lookup_reached: list[int] = field(default_factory=list)  # the same for drafts by prompt lookup
    lookup_accepted: list[int] = field(default_factory=list)
    lookup_rows: int = 0  # rows with a lookup proposal, of
    drafting_rows: int = 0  # the rows of the steps that drafted
    engine_times: dict = field(default_factory=dict)  # N verified tokens -> deque of engine seconds per step
    draft_times: dict = field(default_factory=dict)  # (bucket, k, network) -> deque of proposer seconds per step
    last_max: dict = field(default_factory=dict)  # bucket -> step of the latest k = max
    backoff: dict = field(default_factory=dict)  # bucket -> multiplier of explore_every
    catch_up_times: deque = field(default_factory=lambda: deque(maxlen=32))  # seconds per token of catch-ups
    lengths: OutputLengths = field(default_factory=OutputLengths)
    steps: int = 0

    def __post_init__(self):
        if self.fixed is not None and not 0 <= self.fixed <= self.max_tokens:
            raise ValueError(f"draft_length={self.fixed} must lie in [0, num_speculative_tokens={self.max_tokens}].")
        for name in ("reached", "accepted", "lookup_reached", "lookup_accepted"):
            setattr(self, name, getattr(self, name) or [0] * self.max_tokens)

    # -- what was measured ------------------------------------------------------------------------------------------
    def record_acceptance(self, drafted: int, accepted: int, by_lookup: bool = False) -> None:
        """One row's draft of `drafted` tokens (by the network, or by prompt lookup) of which the first `accepted`
        were accepted."""
        reached, hits = (self.lookup_reached, self.lookup_accepted) if by_lookup else (self.reached, self.accepted)
        for i in range(min(drafted, accepted + 1)):
            reached[i] += 1
            hits[i] += i < accepted

    def record_rows(self, lookup_rows: int, rows: int) -> None:
        """A drafting step's rows, `lookup_rows` of which had a lookup proposal."""
        self.lookup_rows += lookup_rows
        self.drafting_rows += rows

    def record_step(
        self, batch_size: int, k: int, tokens: int, engine_s: float, draft_s: float | None, network: bool = True
    ) -> None:
        """A step of `batch_size` rows at draft length k (drafting with the network or by lookup only) that verified
        `tokens` tokens: the engine took `engine_s` seconds, and the proposer `draft_s` to draft for it (None: not a
        steady-state draft, e.g. rows caught up from scratch, whose one-off cost is not a per-step one)."""
        self.engine_times.setdefault(tokens, deque(maxlen=self.window)).append(engine_s)
        if draft_s is not None:
            key = (batch_bucket(batch_size), k, network or k == 0)
            self.draft_times.setdefault(key, deque(maxlen=self.window)).append(draft_s)

    def record_catch_up(self, tokens: int, seconds: float) -> None:
        """A row's one-off catch-up: `tokens` verified tokens read in `seconds`."""
        if tokens > 0:
            self.catch_up_times.append(seconds / tokens)

    def catch_up_seconds(self, tokens: int) -> float:
        """C n: the time to catch `tokens` tokens up (0 before the first catch-up is measured)."""
        return statistics.median(self.catch_up_times) * tokens if self.catch_up_times and tokens else 0.0

    def acceptance_rates(self, by_lookup: bool = False) -> list[float]:
        """a_i, the share of (network or lookup) drafts reaching position i that were accepted there (a prior of
        1/2 before data)."""
        reached, hits = (self.lookup_reached, self.lookup_accepted) if by_lookup else (self.reached, self.accepted)
        return [(a + 1) / (r + 2) for a, r in zip(hits, reached)]

    def expected_tokens(self, k: int, by_lookup: bool = False) -> float:
        """E(k): tokens a row gains per step with draft length k (network drafts, or lookup drafts)."""
        total, p = 1.0, 1.0
        for a in self.acceptance_rates(by_lookup)[:k]:
            p *= a
            total += p
        return total

    def lookup_share(self) -> float:
        """p, the share of rows with a lookup proposal (0 with lookup off; a prior of 1/2 before data)."""
        return (self.lookup_rows + 1) / (self.drafting_rows + 2) if self.lookup else 0.0

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

    def draft_seconds(self, batch_size: int, k: int, network: bool = True) -> float | None:
        """D(B, k): the proposer's median time at this batch bucket and k (with the network, or by lookup only); an
        unmeasured 0 < k < max from k = max's time (its catch-up is the same, drafting ~ k); None when k = max is
        unmeasured."""
        network = network or k == 0
        times = self.draft_times.get((batch_bucket(batch_size), k, network))
        if times and (k == 0 or len(times) >= self.samples):
            return statistics.median(times)
        if k == 0:
            return 0.0
        top = self.draft_times.get((batch_bucket(batch_size), self.max_tokens, network))
        if not top or len(top) < self.samples:
            return None
        return statistics.median(top) * (1 + k) / (1 + self.max_tokens)

    def throughput(
        self,
        batch_size: int,
        k: int,
        optimistic: bool = False,
        network: bool = True,
        catch_up: int = 0,
        remaining: float | None = None,
    ) -> float | None:
        """Tokens per second the model predicts at draft length k, drafting with the network or by lookup only (None:
        unmeasured); `optimistic`: with drafting free (what drafting could at best give) but for the one-off catch-up
        of `catch_up` tokens the network needs first, spread over the `remaining` tokens (mean) its rows have left."""
        p = self.lookup_share() if k else 0.0
        by_network = self.expected_tokens(k) if network else 1.0
        gained = p * self.expected_tokens(k, by_lookup=True) + (1 - p) * by_network  # per row
        drafted = k * (p + (1 - p) * network)  # tokens drafted per row
        engine = self.engine_seconds(round(batch_size * (1 + drafted)))
        draft = 0.0 if optimistic else self.draft_seconds(batch_size, k, network)
        if engine is None or draft is None:
            return None
        one_off = 0.0
        if network and k and catch_up:
            steps_left = max(1.0, (self.lengths.prior if remaining is None else remaining) / gained)
            one_off = self.catch_up_seconds(catch_up) / steps_left
        return batch_size * gained / (engine + draft + one_off)

    # -- the choice ---------------------------------------------------------------------------------------------------
    def _measured(self, batch_size: int, k: int, network: bool = True) -> int:
        return len(self.draft_times.get((batch_bucket(batch_size), k, network or k == 0), ()))

    def choose(self, batch_size: int) -> int:
        """The draft length for the next step at `batch_size` rows (see `plan`)."""
        return self.plan(batch_size)[0]

    def plan(self, batch_size: int, catch_up: int = 0, remaining: float | None = None) -> tuple[int, bool]:
        """The draft length for the next step at `batch_size` rows, and whether the network drafts (False: rows
        without a lookup proposal stay undrafted).

        Drafting is measured (k = max with the network, by lookup only, then 0, `samples` steps each) at a batch size
        only while the model says it could pay: with no engine time yet, or when even free drafting would beat plain
        decoding by `explore_margin` by the engine times measured so far (at any batch size with the same tokens per
        step); trying is not free, every row must first be caught up. Then the best choice by the model; k = max is
        measured again after `explore_every` steps, an interval that doubles each time it loses. `catch_up`: the
        verified tokens the network would read first (rows it does not follow yet), `remaining`: the mean tokens
        those rows have left (see `throughput`)."""
        self.steps += 1
        if self.fixed is not None:
            return self.fixed, True
        bucket = batch_bucket(batch_size)
        sources = (True, False) if self.lookup else (True,)  # with the network; by lookup only
        options = [(k, net) for k in range(1, self.max_tokens + 1) for net in sources]
        plain = self.throughput(batch_size, 0)
        extra = {"catch_up": catch_up, "remaining": remaining}
        ks = range(1, 1 + self.max_tokens)
        free = {n: max((self.throughput(batch_size, k, True, n, **extra) or 0.0) for k in ks) for n in sources}
        pays = {n: plain is None or free[n] > self.explore_margin * plain for n in sources}  # could drafting pay
        could_pay = any(pays.values())
        if could_pay:
            for k, net in [(self.max_tokens, n) for n in sources if pays[n]] + [(0, True)]:
                if self._measured(batch_size, k, net) < self.samples:  # measure both ends at this batch size
                    return self._chose(bucket, k, net)
        scores = {(0, True): self.throughput(batch_size, 0)}
        scores.update({(k, n): self.throughput(batch_size, k, network=n, **extra) for k, n in options})
        known = [c for c in scores if scores[c] is not None]
        k, net = max(known, key=lambda c: scores[c], default=(0, True))
        interval = self.explore_every * self.backoff.get(bucket, 1)
        full = (self.max_tokens, True)  # k = max with the network: what acceptance drift could make pay again
        if pays[True] and (k, net) != full and self.steps - self.last_max.get(bucket, 0) > interval:
            self.backoff[bucket] = 2 * self.backoff.get(bucket, 1)  # look again, later each time it loses
            return self._chose(bucket, *full)
        if (k, net) == full:
            self.backoff[bucket] = 1
        return self._chose(bucket, k, net)

    def _chose(self, bucket: int, k: int, network: bool = True) -> tuple[int, bool]:
        if (k, network) == (self.max_tokens, True):
            self.last_max[bucket] = self.steps
        return k, network

    def as_dict(self) -> dict:
        return {
            "acceptance_by_position": [round(a, 4) for a in self.acceptance_rates()],
            "lookup_acceptance_by_position": [round(a, 4) for a in self.acceptance_rates(by_lookup=True)],
            "lookup_share": round(self.lookup_share(), 4),
            "catch_up_s_per_token": round(self.catch_up_seconds(1), 7),
            "finished_rows_mean_tokens": round(statistics.mean(self.lengths.finished), 1)
            if self.lengths.finished
            else None,
            "engine_s_by_tokens": {n: round(statistics.median(t), 5) for n, t in sorted(self.engine_times.items())},
            "draft_s": {
                f"batch<={b},k={k}{'' if net else ',lookup only'}": round(statistics.median(t), 5)
                for (b, k, net), t in self.draft_times.items()
            },
        }
