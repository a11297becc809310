"""The shape policy: what each cycle drafts and verifies, chosen from what this machine measures.

Costs (`measure_costs`, once per target, drafter, batch size and process): `verify[n]` the seconds of one target
forward over n new tokens per row (a tree of n - 1 nodes and its root), `step[w]` of one drafter depth over w nodes.
The cycle's own time beyond them (the drafter's catch-up and the loop) is tracked from the cycles themselves, and
the verification table is fitted to what the cycles' verifications took (it follows the context length).

A cycle with n verified nodes of path probabilities p_i (the drafter's, calibrated) and drafting time D gains
E[tokens] = B + sum_i p_i for the batch of B rows, and costs T(n) = fixed + D + verify(n + 1). The policy

    drafts deeper / wider   while the frontier's expected tokens pay for a drafter step and for verifying them
    cuts the tree to the n  that maximises E[tokens] / T(n)                                    (`cut_to_budget`)
    calibrates              the drafter's probabilities: score = gamma x log p, gamma fitted so that the expected
                            accepted drafts track the accepted ones                                 (`update`)
    weights lookup          prompt lookup's token j by its measured right rate at position j given the earlier
                            ones right (lookup is right in runs: reached deep positions are right more often), kept
                            per class of proposal length (a longer proposal followed a longer matched n-gram)
    plays arms              per context: where every row has a prompt lookup continuation ("found"), lookup alone (no
                            drafter forward) or the tree (lookup as a branch); elsewhere ("none"), a chain (top-k 1),
                            the tree, and lookup where rows have one (batches) or else plain decoding; plain decoding
                            beside lookup at batches (a batch's cut keeps as many nodes for every row). The lookup arm
                            decodes plainly where its cut keeps no node. The arm with the fewest measured seconds per
                            token in the cycle's context (decayed over its latest cycles) plays; each other arm is
                            probed again after EXPLORE_EVERY x (its rate / the best's)^2 cycles of that context (at
                            most `MAX_EXPLORE_GAP` x that ratio, doubled per probe the arm lost in a row, up to
                            `MAX_BACKOFF` times): a far slower arm is probed rarely. Rates kept per context (and per
                            count of rows still decoding) compare arms on the same kind of cycle; at batch 1 no plain
                            arm beside lookup's: its noisy rate kept it playing where lookup paid (docs/design.md)
    starts the drafter      only where a network arm may pay: the drafter's start (reading every row's prompt) is a
                            one-off that only a network arm repays, so a call whose predecessors measured every
                            network arm well behind the best plays lookup and plain decoding (every
                            `REFRESH_CALLS`-th call measures the network again)
    fits verification       the table's one-token cost and each further token's cost scaled separately to what the
                            cycles' verifications took (`VerifyFit`): a longer context makes further tokens dearer
    carries                 what a call learned (arms' rates, lookup's rates, gamma) to the next call with the same
                            costs (`Costs.learned`), as a prior

Drafting (tree.py: `build_tree`, `add_chain`, `cut_to_budget`) is kept apart from adapting (`ShapePolicy.update`), as
transformers keeps `get_candidates` apart from `update_candidate_strategy`. Fixed settings (`TreeSettings`) bypass
what they fix. The decision itself (the arm and the cut of most expected tokens per second: `best`, `best_index`; the
probes: `ProbeSchedule`) and what it is priced with (lookup's rates by position, the verification fit) are the policy
core's (policy_core.py), which vLLM's proposer and the serving client decide with too: this file is the engine's
adapter over it. It ships inside every published drafter repo (custom_generate/): it imports only torch and its
siblings.
"""

import functools
import logging
import time
from dataclasses import dataclass, field

import torch

from .policy_core import PositionRates, ProbeSchedule, VerifyFit, best, interpolate, unmeasured

__all__ = [
    "Costs",
    "ShapePolicy",
    "TreeSettings",
    "measure_costs",
    "measure_step_costs",
    "synchronize",
    "wall_times",
    "VERIFY_SIZES",
    "STEP_WIDTHS",
]

logger = logging.getLogger(__name__)

VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)
STEP_WIDTHS = (1, 2, 4, 8)


@dataclass
class TreeSettings:
    """The draft tree's shape. None: chosen per cycle from the measured costs and the drafter's probabilities.

    depth: most drafter steps per cycle (the tree's depth); top_k: children kept per expanded node, and most nodes
    expanded per depth; budget: most drafted nodes the target verifies per cycle; lookup: add prompt lookup's
    continuation as a branch (None: as the drafter's config says). top_k=1 with lookup=False drafts a chain.
    """

    depth: int | None = None
    top_k: int | None = None
    budget: int | None = None
    lookup: bool | None = None
    max_depth: int = 10  # bounds of the automatic choice
    max_top_k: int = 8
    max_budget: int = 64

    def __post_init__(self):
        for name in ("depth", "top_k", "budget"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < (0 if name == "budget" else 1)):
                raise ValueError(f"tree_{name} must be a positive integer or None (automatic), got {value!r}.")

    @property
    def automatic(self) -> bool:
        return self.depth is None or self.top_k is None or self.budget is None


@dataclass
class Costs:
    """Seconds on this hardware: `verify[n]` for one target forward over n new tokens of every row of the batch,
    `step[w]` for one drafter tree step over w nodes per row. Piecewise-linear in between, linear beyond."""

    verify: dict[int, float]
    step: dict[int, float]
    # what the shape policy learned in the latest call with these costs (`ShapePolicy.learned`: its arms' rates,
    # lookup's right rates, the calibration): the next call starts from it instead of from priors
    learned: dict = field(default_factory=dict, repr=False, compare=False)

    def verify_cost(self, n: int) -> float:
        return interpolate(sorted(self.verify.items()), n)

    def step_cost(self, w: int) -> float:
        return interpolate(sorted(self.step.items()), w)

    def as_dict(self) -> dict:
        return {"verify": dict(self.verify), "step": dict(self.step)}


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work (a CUDA device runs kernels after the host has moved on; a CPU does not)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_times(fn, device: torch.device, repeats: int = 3) -> list[float]:
    """Sorted wall seconds of `repeats` calls of fn (after a warm-up call), its work on `device` included."""
    fn()  # warm-up
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)


def measure_costs(target, drafter, run, verify_sizes=VERIFY_SIZES, step_widths=STEP_WIDTHS, steps=True) -> Costs:
    """Time the target verifying n dummy tokens per row on the run's cache (cropped back after each) and, with
    `steps`, the drafter's tree step (`measure_step_costs`; else `Costs.step` stays empty until it is measured), on
    this hardware, with this batch."""
    B = run.roots.shape[0]
    root = run.roots[:, None]  # [B, 1]

    def verify(n):
        ids = root.expand(B, n)  # [B, n]
        q_pos = run.root_pos[:, None] + torch.arange(n, device=ids.device)  # [B, n]
        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril().expand(B, n, n)
        run.target_forward(ids, q_pos, causal)
        run.slots.rollback()  # the dummy tokens dropped

    verify_t = {n: wall_times(functools.partial(verify, n), root.device)[0] for n in verify_sizes}
    return Costs(verify=verify_t, step=measure_step_costs(drafter, run, step_widths) if steps else {})


def measure_step_costs(drafter, run, step_widths=STEP_WIDTHS) -> dict[int, float]:
    """{w: seconds of the drafter's tree step over w dummy nodes per row (forgotten after each)}, on the run's drafter
    state (caught up on the verified tokens)."""
    B = run.roots.shape[0]
    root = run.roots[:, None]  # [B, 1]

    def step(w):
        ids = root.expand(B, w)  # [B, w]
        drafter.tree_step(run.draft_state, ids, run.root_pos[:, None].expand(B, w) + 1, torch.full_like(ids, -1))
        drafter.tree_end(run.draft_state)

    return {w: wall_times(functools.partial(step, w), root.device)[0] for w in step_widths}


@dataclass
class Shape:
    """One cycle's plan: drafter steps (`depth`, 0: plain decoding), children per node (`top_k`), `widths`: the
    frontier per depth (a function of the newest scores, or None: top_k), `budget` (None: by expected tokens per
    second), `lookup`, `lookup_first` (where every row has a lookup continuation, verify it alone: no drafter call,
    the drafter catches up later), `network` (False: the drafter is not called, lookup's continuations alone, where
    rows have one), and why (for the debug log)."""

    depth: int
    top_k: int
    widths: object = None
    budget: int | None = None
    lookup: bool = False
    why: str = ""
    lookup_first: bool = False
    network: bool = True


class ShapePolicy:
    """Chooses each cycle's shape (`plan`, `widths`, `cycle_seconds`, `lookup_log_probs`) and adapts from what the
    cycles measured (`update`). One per engine call; `batch` rows; `costs` as measured; `carried`: what an earlier
    call with the same costs learned (`learned`; a prior this call's cycles soon outweigh).

    Contexts (`context`): "found" where prompt lookup has a continuation for every row, "none" elsewhere (and when
    lookup is off). Arms: the shape families the policy plays in a context (`arms`): plain decoding, lookup (prompt
    lookup's continuations, no drafter forward, plain decoding for rows without one), a chain (top-k 1, where some row
    has no continuation: with one for every row the chain is lookup alone) and the tree (top-k from the costs, lookup
    as a branch). Each (context, arm) keeps decayed sums of the seconds and tokens of the cycles it played (plain
    decoding one set for both contexts: its cost does not depend on lookup), so its rate (seconds per token of the
    batch) follows the context length as it grows. Each arm is probed `PROBE` cycles, then the policy plays the arm
    with the lowest rate in the cycle's context, and one cycle of another arm once it has not played for
    `EXPLORE_EVERY` x (its rate / the best's)^2 cycles of that context (at most `MAX_EXPLORE_GAP` x that ratio: a
    slower arm's look costs more, and an arm that drafts with the network pays the catch-up of every token since it
    last played), doubled for each probe in a row after which the arm was still slower than another (at most
    2^`MAX_BACKOFF` x; a call starts one doubling lower than the last ended): an arm close to the best is looked at
    often (it may overtake), a far slower or a repeatedly losing one rarely (each look costs). Its choice is never
    worse, for long, than the best of the shapes it could have fixed per context, plain decoding included, at the
    price of those probes. When rows finish, a token of the rest costs more: rates at each count of rows still
    decoding are kept apart (`_set_rows`), so arms measured with 8 rows and with 2 are not compared.
    """

    PROBE = 2  # cycles each arm is played before the policy compares them
    DECAY = 0.9  # weight of an arm's past cycles per newer cycle of it
    EXPLORE_EVERY = 16  # cycles between two plays of an arm as fast as the best (more for slower arms)
    MAX_EXPLORE_GAP = 48  # the most cycles an arm goes unplayed, per (its rate / the best's)
    MAX_BACKOFF = 3  # a probe that loses doubles the arm's interval, at most 2**MAX_BACKOFF times
    NETWORK_ARMS = ("tree", "chain")  # the arms that run the drafter's network
    START_MARGIN = 1.1  # the network arms play in a call if one's carried rate is within this factor of the best
    REFRESH_CALLS = 8  # ... or after this many calls without them (their rates are measured again)
    CARRIED_TRIES = 16  # the most weight an earlier call's lookup right rate keeps per position
    LOOKUP_CLASSES = 5  # lookup proposals of 1, 2-3, 4-7, 8-15, 16+ tokens keep right rates apart

    def __init__(self, settings: TreeSettings, costs: Costs, batch: int, lookup: bool, carried: dict | None = None):
        self.settings, self.costs, self.batch, self.lookup = settings, costs, batch, lookup
        self.step_s = costs.verify_cost(1)  # a plain decoding cycle of the batch: tracked from the plain cycles
        self.fixed_s = 0.0  # the speculative cycle's time beyond drafting and verifying (catch-up, loop): tracked
        self.gamma, self.predicted, self.realised = 1.0, 1.0, 1.0  # calibration of the drafter's probabilities
        # lookup's token j (0-based) given tokens < j right, per class of proposal length and position (priors 0.6,
        # then 0.8): lookup is right in runs (a copied passage), so deep positions that are reached are right more
        # often
        lookup_prior = ((1.2, 2.0), (1.6, 2.0))
        self.lookup_rates = PositionRates(settings.max_budget, self.LOOKUP_CLASSES, lookup_prior, bounds=(0.05, 0.98))
        self.node_cost = max(costs.verify_cost(2) - costs.verify_cost(1), 1e-9)  # one more verified node (batch)
        self.fit = VerifyFit(costs.verify_cost)  # the table scaled to what verifications take: follows the context
        self.chosen: dict[tuple, int] = {}  # (arm key, depth, verified nodes) -> cycles, for the call's debug summary
        contexts = self.CONTEXTS if lookup else ("none",)
        self.arms = {c: self._arms(settings, lookup, c, batch) for c in contexts}  # context -> its arms
        keys = {self.key(c, a) for c, arms in self.arms.items() for a in arms}
        self.sums = {k: [0.0, 0.0, 0] for k in sorted(keys)}  # arm key -> [decayed seconds, decayed tokens, cycles]
        self.rows = batch  # rows still decoding: rates at fewer rows are kept apart (`_set_rows`)
        carried = carried or {}
        for k, (sec, tok) in carried.get("arms", {}).items():
            if k.split("@")[0] in keys and tok > 0:  # an earlier call's rate, weighted as one cycle
                self.sums[k] = [sec / tok, 1.0, self.PROBE]
        self.probing = False  # the current cycle plays an arm that is not the best (`update` scores the probe)
        self.lookup_rates.load(carried.get("lookup", ()), self.CARRIED_TRIES)  # an earlier call's, weighted
        self.gamma = carried.get("gamma", self.gamma)
        self.idle_calls = carried.get("idle_calls", 0)  # earlier calls in a row without the network
        self.network = self._network_may_pay()
        if not self.network:  # the drafter is not started: the call plays lookup and plain decoding
            self.arms = {c: tuple(a for a in arms if a not in self.NETWORK_ARMS) for c, arms in self.arms.items()}
        self.network_played = False
        self.context = "none"
        self.arm = self.arms[self.context][0]
        self.cycles = dict.fromkeys(self.CONTEXTS, 0)  # cycles per context: the probes' clock of (context, arm)
        # (context, arm) -> probes lost in a row (its interval doubles per loss; an earlier call's, one fewer) and the
        # cycle of its context it last played in (counting back into earlier calls: an arm's interval can be longer
        # than a call, and a call's few cycles must not keep the arm unprobed for good)
        losses = {tuple(k.split("/")): max(0, n - 1) for k, n in carried.get("losses", {}).items()}
        since = carried.get("since", {})
        last = {(c, a): -since.get(f"{c}/{a}", 1) for c, arms in self.arms.items() for a in arms}
        self.probes = ProbeSchedule(most=2**self.MAX_BACKOFF, losses=losses, last=last)

    CONTEXTS = ("found", "none")

    def _network_may_pay(self) -> bool:
        """Whether this call's arms include the network's. The drafter's start (reading every row's prompt, 0.37 s
        at batch 8 here) is a one-off only a network arm can repay: where earlier calls measured every network arm
        more than `START_MARGIN` x slower than its context's best, in every context that measured one, the call
        leaves the drafter off; every `REFRESH_CALLS`-th call plays them again to measure them anew."""
        if not self.settings.automatic or self.idle_calls >= self.REFRESH_CALLS:
            return True
        measured = False
        for c, arms in self.arms.items():
            rates = {a: r for a in arms if (r := self.rate(a, c)) is not None}
            net = [r for a, r in rates.items() if a in self.NETWORK_ARMS]
            if net:
                measured = True
                if min(net) <= self.START_MARGIN * min(rates.values()):
                    return True
        return not measured

    @staticmethod
    def key(context: str, arm: str) -> str:
        """The name an arm's measured rate is kept under: plain decoding's is the same in every context."""
        return arm if arm == "plain" else f"{context}/{arm}"

    def _rows_key(self, context: str, arm: str) -> str:
        """`key` at the rows still decoding: the call's batch, or `key@rows` once rows have finished."""
        k = self.key(context, arm)
        return k if self.rows == self.batch else f"{k}@{self.rows}"

    def _set_rows(self, rows: int) -> None:
        """Rows have finished: a token of the remaining rows costs more (a forward reads the weights for fewer rows),
        and arms measured at different row counts must not be compared. Rates at `rows` are kept apart; an arm with
        none yet starts from its rate at the former count x (former / rows) (one cycle's weight): the arms' order
        is kept until they are measured again."""
        old = {(c, a): self._rows_key(c, a) for c, arms in self.arms.items() for a in arms}
        former, self.rows = self.rows, rows
        for (c, a), old_key in old.items():
            new_key = self._rows_key(c, a)
            sec, tok, n = self.sums[old_key]
            if new_key not in self.sums:
                self.sums[new_key] = [sec / tok * former / rows, 1.0, n] if tok > 0 else [0.0, 0.0, n]

    @staticmethod
    def context_of(chains: list | None) -> str:
        """The cycle's context: "found" where prompt lookup has a continuation for every row, else "none"."""
        return "found" if chains and all(c is not None for c in chains) else "none"

    @staticmethod
    def _arms(s: TreeSettings, lookup: bool, context: str, batch: int) -> tuple:
        """The arms of a context. With a continuation for every row a chain is lookup alone (the lookup arm); at
        batch 1 without one the lookup arm is plain decoding. At batch 1 the lookup arm's cut verifies no node (a
        plain cycle) where lookup's expected tokens do not pay for verifying them: no plain arm beside it. A batch's
        cut keeps the same number of nodes for every row, rows whose lookup pays and rows whose does not: a plain arm
        beside it measures whether verifying pays for the batch."""
        if not s.automatic:
            return ("fixed",)
        found = lookup and context == "found"
        if s.top_k is not None:
            families = ("fixed",)
        else:
            families = ("tree",) if found else ("tree", "chain")
        with_lookup = lookup and (found or batch > 1)
        plain = not with_lookup or batch > 1
        return (*families, *(("lookup",) if with_lookup else ()), *(("plain",) if plain else ()))

    def rate(self, arm: str, context: str | None = None) -> float | None:
        """Seconds per token of the batch that `arm` measured in `context` (default: the current one; decayed), None
        before it played."""
        sec, tok, _ = self.sums[self._rows_key(context or self.context, arm)]
        return sec / tok if tok > 0 else None

    def _next_arm(self) -> str:
        """The arm of the next cycle in the current context: an arm not probed yet; else the best (the fewest
        measured seconds per token), but an arm due a probe first (`ProbeSchedule`, on the context's cycles: its base
        interval `EXPLORE_EVERY` x (its rate / the best's)^2, at most `MAX_EXPLORE_GAP` x that ratio): an arm's rate
        drifts with the context length and the text."""
        c, arms = self.context, self.arms[self.context]
        if len(arms) == 1:
            return arms[0]
        first = unmeasured(arms, lambda a: self.sums[self._rows_key(c, a)][2], self.PROBE)
        if first is not None:
            return first
        best_arm = best(arms, seconds_per_token=self.rate)
        top = max(self.rate(best_arm), 1e-9)

        def base(arm: str) -> float:
            ratio = self.rate(arm) / top
            return min(self.MAX_EXPLORE_GAP * ratio, self.EXPLORE_EVERY * ratio**2)

        probe = self.probes.probe({(c, a): base(a) for a in arms if a != best_arm}, self.cycles[c])
        if probe is None:
            return best_arm
        self.probing = True
        return probe[1]

    def learned(self) -> dict:
        """What to carry to the next call with these costs: the arms' {arm: (seconds, tokens)}, lookup's (right,
        tried) per position, the calibration gamma, the probes each arm lost in a row, the cycles since each arm
        last played and the calls in a row without the network."""
        arms = {k: (sec, tok) for k, (sec, tok, _) in self.sums.items() if tok > 0}
        lookup = self.lookup_rates.state()
        losses = {f"{c}/{a}": n for (c, a), n in self.probes.losses.items() if n}
        idle = 0 if self.network_played else self.idle_calls + 1
        since = {f"{c}/{a}": self.cycles[c] - last for (c, a), last in self.probes.last.items()}
        return {
            "arms": arms,
            "lookup": lookup,
            "gamma": self.gamma,
            "losses": losses,
            "idle_calls": idle,
            "since": since,
        }

    # ----- drafting side: what to draft this cycle ----------------------------------------------------------------
    @property
    def token_s(self) -> float:
        """Seconds one more token of the batch is worth: the best arm's measured rate (plain decoding's before)."""
        known = [r for r in map(self.rate, self.arms[self.context]) if r is not None]
        return min(known) if known else self.step_s / self.batch

    def plan(self, remaining: int, context: str = "none", rows: int | None = None) -> Shape:
        """This cycle's shape; `remaining`: tokens the longest row may still generate; `context`: `context_of` the
        rows' lookup continuations; `rows`: the rows still decoding (default: the batch)."""
        s = self.settings
        self.context, self.probing = context, False
        if (rows or self.batch) != self.rows:
            self._set_rows(rows or self.batch)
        if remaining <= 1 or s.budget == 0:  # a plain cycle: measured for plain decoding (or lookup's arm: its cut)
            self.arm = self.arms[context][-1]
            return Shape(0, 1, why="no room for drafts" if remaining <= 1 else "budget 0")
        self.arm = self._next_arm()
        if self.arm == "plain":
            return Shape(0, 1, why=self._why())
        if self.arm == "lookup":  # no drafter forward: lookup's continuations (cut by cost) where rows have one
            return Shape(1, 1, None, s.budget, True, self._why(), lookup_first=True, network=False)
        top_k = 1 if self.arm == "chain" else s.top_k or s.max_top_k
        fixed_k = 1 if self.arm == "chain" else s.top_k
        depth = min(s.depth or s.max_depth, remaining - 1)
        widths = None
        if s.depth is None or fixed_k is None:
            widths = functools.partial(self._width, fixed_depth=s.depth is not None, fixed_k=fixed_k)
        lookup = bool(self.lookup)
        return Shape(depth, top_k, widths, s.budget, lookup, self._why(), lookup_first=lookup and top_k == 1)

    def _why(self) -> str:
        arms = self.arms[self.context]
        rates = ", ".join(f"{a} {1000 * r:.1f}" for a in arms if (r := self.rate(a)) is not None)
        return f"{self.context}: arm {self.arm} (ms per token: {rates or 'none measured'})"

    def _width(self, d: int, newest: torch.Tensor, fixed_depth: bool, fixed_k: int | None) -> int:
        """The frontier at depth d (0: stop drafting): the newest nodes whose path probability pays for verifying
        them (at least one), while the frontier's expected tokens pay for one more drafter step."""
        p = newest.exp()  # [B, c]
        k = min(fixed_k or self.settings.max_top_k, newest.shape[1])
        if fixed_k is None:  # columns of the batch's nodes, most probable first, that pay for their verification
            columns = p.sort(dim=-1, descending=True).values.sum(0)  # [c]
            k = max(1, min(k, int((columns * self.token_s > self.fit.extra * self.node_cost).sum())))
        if not fixed_depth:
            front = p.topk(k, dim=-1).values.sum()  # the batch's expected tokens below the frontier, at most
            if float(front) * self.token_s < self.costs.step_cost(k):
                return 0
        return k

    def cycle_seconds(self, limit: int, draft_s: float) -> torch.Tensor:
        """[limit+1]: the cycle's predicted seconds with n = 0..limit nodes verified."""
        return self.fixed_s + draft_s + self.fit.seconds(limit + 1)

    def lookup_log_probs(self, n: int, length: int | None = None) -> list[float]:
        """Estimated log probability that the first j tokens of a lookup proposal of `length` tokens (default n) are
        all right, j = 1..n: right rates kept per class of proposal length (`PositionRates.length_class`; a drafter
        proposes more tokens after a longer matched n-gram, which is right more often: one set of rates for all would
        cut a long match short and keep a 1-token match too long)."""
        return self.lookup_rates.log_probs(n, length)

    # ----- adapting side: what the cycle measured ------------------------------------------------------------------
    def update(self, tree, lengths: list, lookup_right: list, seconds: float, draft_s: float, verify_s: float):
        """After a cycle: `tree` verified, `lengths` [B] accepted drafts per row, `lookup_right` per row with a lookup
        chain (tokens of it checked, of which right: a prefix, and the proposal's length), the cycle's wall `seconds`
        of which `draft_s` drafting and `verify_s` verifying."""
        tokens = sum(lengths) + len(lengths)
        self.fit.update(1 + tree.size, verify_s)
        key = self.key(self.context, self.arm)
        # a cycle of a drafting arm that drafted nothing counts for it: its own choice
        sums = self.sums[self._rows_key(self.context, self.arm)]
        sums[0], sums[1], sums[2] = self.DECAY * sums[0] + seconds, self.DECAY * sums[1] + tokens, sums[2] + 1
        self.probes.played((self.context, self.arm), self.cycles[self.context])
        self.network_played |= self.arm in self.NETWORK_ARMS
        self.cycles[self.context] += 1
        if self.probing:  # a probe lost if its arm is still slower than another: its next one waits longer
            c, arm = self.context, self.arm
            mine = self.rate(arm)
            lost = any((r := self.rate(a)) is not None and r < mine for a in self.arms[c] if a != arm)
            self.probes.lost((c, arm)) if lost else self.probes.won((c, arm))
        if tree.size == 0:  # a plain cycle
            self.step_s = 0.8 * self.step_s + 0.2 * verify_s
            return
        self.fixed_s = 0.8 * self.fixed_s + 0.2 * max(0.0, seconds - draft_s - verify_s)
        shape = (key, int(tree.depth.max()), tree.size)
        self.chosen[shape] = self.chosen.get(shape, 0) + 1
        for checked, right, length in lookup_right:  # token j was checked where the ones before were right
            self.lookup_rates.record(checked, right, length)
        # calibration: the expected accepted drafts (sum of the verified nodes' path probabilities) track the accepted
        expected = float(torch.where(tree.real, tree.score.exp(), 0.0).sum())
        self.predicted = 0.8 * self.predicted + 0.2 * expected
        self.realised = 0.8 * self.realised + 0.2 * sum(lengths)
        ratio = max(self.predicted, 1e-3) / max(self.realised, 1e-3)
        self.gamma = min(2.0, max(0.2, self.gamma * ratio**0.1))

    def summary(self) -> dict:
        """What the policy chose and measured over the call (the debug log, `moa costs`)."""
        plain = self.sums.get("plain", [0, 0, 0])[2]
        return {
            "shapes": {f"{a}: depth {d}, {n} nodes": c for (a, d, n), c in sorted(self.chosen.items())},
            "plain_cycles": plain,
            "arm_ms_per_token": {k: 1000 * sec / tok for k, (sec, tok, _) in self.sums.items() if tok > 0},
            "arm_cycles": {k: n for k, (_, _, n) in self.sums.items()},
            "gamma": self.gamma,
            "lookup_right_by_position": {
                f"proposals of {2**c}+ tokens": rates for c, rates in enumerate(self.lookup_rates.table(8))
            },
            "fixed_ms": 1000 * self.fixed_s,
            "plain_step_ms": 1000 * self.step_s,
            "verify_over_table": {"one_token": self.fit.base, "per_more_token": self.fit.extra},
            "arms": {c: list(arms) for c, arms in self.arms.items()},
            "network": self.network,
        }
