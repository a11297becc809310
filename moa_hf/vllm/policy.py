"""How many tokens vLLM's proposer drafts per row at the current batch size: an adapter over the policy core
(modeling/custom_generate/policy_core.py: `best`, `ProbeSchedule`) that prices a step of B rows and a row's remaining
tokens (with what only vLLM measures, pricing.py).

A *step* is one engine iteration (the target verifies every row's draft, then the proposer drafts the next); the
*draft length* k is the most tokens a row drafts (0: plain decoding). A row gains E(k) tokens per step, a step of
B rows costs T(B (1 + k)) + D(B, k) seconds: T the engine's time for a step verifying N tokens (measured by N: one
batch size serves every other with the same N), D the proposer's (per batch bucket and k); the core's `best` takes
the k of most B E / (T + D).

With prompt lookup on, a share p of the rows have a lookup proposal (no forward); a step runs the network for the
rest or leaves them undrafted (*lookup only*): a row gains p E_lookup(k) + (1 - p) E_network(k) (or 1). Before the
network drafts for a row it does not follow, it reads the row's verified tokens (`CatchUpPrice`), a cost spread over
the tokens the row has left (`OutputLengths`: vLLM does not tell a proposer its requests' `max_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..modeling.custom_generate.policy_core import PositionRates, ProbeSchedule, best, unmeasured
from .pricing import CatchUpPrice, MeasuredCosts, OutputLengths, batch_bucket

__all__ = ["VllmDraftPolicy"]


@dataclass
class VllmDraftPolicy:
    max_tokens: int  # vLLM's num_speculative_tokens
    fixed: int | None = None  # always draft this many (no measuring)
    samples: int = 2  # measurements of k = 0 and k = max at a batch bucket before choosing from the model
    window: int = 16  # newest measurements kept per key
    explore_every: int = 64  # steps without k = max before it is measured again where the model chose less
    explore_margin: float = 1.1  # measure drafting only where free drafting beats plain decoding by this factor
    lookup: bool = False  # rows may draft by prompt lookup: also weigh steps that draft by lookup only
    lookup_rows: int = 0  # rows with a lookup proposal, of
    drafting_rows: int = 0  # the rows of the steps that drafted
    lengths: OutputLengths = field(default_factory=OutputLengths)
    catch_up: CatchUpPrice = field(default_factory=CatchUpPrice)
    probes: ProbeSchedule = field(default_factory=ProbeSchedule)  # per batch bucket: when k = max is measured again
    steps: int = 0

    def __post_init__(self):
        if self.fixed is not None and not 0 <= self.fixed <= self.max_tokens:
            raise ValueError(f"draft_length={self.fixed} must lie in [0, num_speculative_tokens={self.max_tokens}].")
        self.network_rates = PositionRates(self.max_tokens)  # the network's drafts (a prior of 1/2)
        self.lookup_rates = PositionRates(self.max_tokens)  # one class: k, not the match, sets its length
        self.engine = MeasuredCosts(self.window)  # N verified tokens -> engine seconds per step
        self.drafts = MeasuredCosts(self.window)  # (bucket, k, network) -> proposer seconds per step

    def record_acceptance(self, drafted: int, accepted: int, by_lookup: bool = False) -> None:
        """One row's draft of `drafted` tokens (by the network, or by prompt lookup) of which `accepted` were."""
        (self.lookup_rates if by_lookup else self.network_rates).record(drafted, accepted)

    def record_rows(self, lookup_rows: int, rows: int) -> None:
        """A drafting step's rows, `lookup_rows` of which had a lookup proposal."""
        self.lookup_rows += lookup_rows
        self.drafting_rows += rows

    def record_step(self, batch: int, k: int, tokens: int, engine_s: float, draft_s: float | None, network=True):
        """A step of `batch` rows at draft length k (with the network or by lookup only) verifying `tokens` tokens:
        the engine took `engine_s`, the proposer `draft_s` (None: not a steady-state draft, e.g. rows caught up)."""
        self.engine.add(tokens, engine_s)
        if draft_s is not None:
            self.drafts.add((batch_bucket(batch), k, network or k == 0), draft_s)

    def lookup_share(self) -> float:
        """p, the share of rows with a lookup proposal (0 with lookup off; a prior of 1/2 before data)."""
        return (self.lookup_rows + 1) / (self.drafting_rows + 2) if self.lookup else 0.0

    def draft_seconds(self, batch: int, k: int, network: bool = True) -> float | None:
        """D(B, k): the proposer's median time (an unmeasured 0 < k < max from k = max's: catch-up + k drafting
        steps); None while k = max is unmeasured."""
        key = (batch_bucket(batch), k, network or k == 0)
        if self.drafts.count(key) >= (1 if k == 0 else self.samples):
            return self.drafts.median(key)
        top = (key[0], self.max_tokens, key[2])
        if k == 0 or self.drafts.count(top) < self.samples:
            return 0.0 if k == 0 else None
        return self.drafts.median(top) * (1 + k) / (1 + self.max_tokens)

    def throughput(self, batch, k, optimistic=False, network=True, catch_up=0, remaining=None) -> float | None:
        """Tokens per second at draft length k, with the network or by lookup only (None: unmeasured); `optimistic`:
        drafting free (what it could at best give) but for the catch-up of `catch_up` tokens the network needs first,
        spread over the `remaining` tokens (mean) its rows have left."""
        p = self.lookup_share() if k else 0.0
        by_network = self.network_rates.expected_tokens(k) if network else 1.0
        gained = p * self.lookup_rates.expected_tokens(k) + (1 - p) * by_network  # per row
        engine = self.engine.at(round(batch * (1 + k * (p + (1 - p) * network))))
        draft = 0.0 if optimistic else self.draft_seconds(batch, k, network)
        if engine is None or draft is None:
            return None
        left = self.lengths.prior if remaining is None else remaining
        one_off = self.catch_up.per_step(catch_up, left, gained) if network and k else 0.0
        return batch * gained / (engine + draft + one_off)

    def choose(self, batch: int) -> int:
        return self.plan(batch)[0]

    def plan(self, batch: int, catch_up: int = 0, remaining: float | None = None) -> tuple[int, bool]:
        """The draft length for the next step at `batch` rows, and whether the network drafts (False: rows without
        a lookup proposal stay undrafted). Drafting is measured (k = max with the network, by lookup only, then 0,
        `samples` steps each) while it could pay: no engine time yet, or free drafting beating plain decoding by
        `explore_margin`. Then the model's best (`best`); k = max is measured again once `explore_every` steps went
        by without it (`ProbeSchedule`: doubled per look it lost). `catch_up`: verified tokens the network would read
        first, `remaining`: the mean tokens those rows have left."""
        self.steps += 1
        if self.fixed is not None:
            return self.fixed, True
        bucket, ks, sources = (
            batch_bucket(batch),
            range(1, self.max_tokens + 1),
            (True, False) if self.lookup else (True,),
        )
        extra = {"catch_up": catch_up, "remaining": remaining}
        plain = self.throughput(batch, 0)
        free = {n: max((self.throughput(batch, k, True, n, **extra) or 0.0) for k in ks) for n in sources}
        pays = {n: plain is None or free[n] > self.explore_margin * plain for n in sources}
        if any(pays.values()):  # measure both ends at this batch size
            ends = [(self.max_tokens, n) for n in sources if pays[n]] + [(0, True)]
            first = unmeasured(ends, lambda o: self.drafts.count((bucket, *o)), self.samples)
            if first is not None:
                return self._chose(bucket, *first)
        options = [(0, True)] + [(k, n) for k in ks for n in sources]  # on a tie the first: plain decoding
        k, net = best(options, lambda o: self.throughput(batch, o[0], network=o[1], **extra), default=(0, True))
        full = (self.max_tokens, True)  # k = max with the network: what acceptance drift could make pay again
        before = self.steps - 1  # steps before this one: k = max is due once `explore_every` of them went without it
        if pays[True] and (k, net) != full and self.probes.due(bucket, before, self.explore_every):
            self.probes.lost(bucket)  # look again, later each time it loses
            return self._chose(bucket, *full)
        if (k, net) == full:
            self.probes.won(bucket)
        return self._chose(bucket, k, net)

    def _chose(self, bucket: int, k: int, network: bool = True) -> tuple[int, bool]:
        if (k, network) == (self.max_tokens, True):
            self.probes.played(bucket, self.steps)
        return k, network

    def as_dict(self) -> dict:
        return {
            "acceptance_by_position": [round(a, 4) for a in self.network_rates.rates(self.max_tokens)],
            "lookup_acceptance_by_position": [round(a, 4) for a in self.lookup_rates.rates(self.max_tokens)],
            "lookup_share": round(self.lookup_share(), 4),
            "catch_up_s_per_token": round(self.catch_up.seconds(1), 7),
            "finished_rows_mean_tokens": self.lengths.mean(),
            "engine_s_by_tokens": dict(self.engine.as_dict()),
            "draft_s": {f"batch<={b},k={k}{'' if n else ',lookup only'}": t for (b, k, n), t in self.drafts.as_dict()},
        }
