"""The shape policy: what each cycle drafts and verifies, chosen from what this machine measures.

Costs (`measure_costs`, once per target, drafter, batch size and process): `verify[n]` the seconds of one target
forward over n new tokens per row (a tree of n - 1 nodes and its root), `step[w]` of one drafter depth over w nodes.
The cycle's own time beyond them (the drafter's catch-up and the loop) is tracked from the cycles themselves.

A cycle with n verified nodes of path probabilities p_i (the drafter's, calibrated) and drafting time D gains
E[tokens] = B + sum_i p_i for the batch of B rows, and costs T(n) = fixed + D + verify(n + 1). The policy

    drafts deeper / wider   while the frontier's expected tokens pay for a drafter step and for verifying them
    cuts the tree to the n  that maximises E[tokens] / T(n)                                    (`cut_to_budget`)
    calibrates              the drafter's probabilities: score = gamma x log p, gamma fitted so that the expected
                            accepted drafts track the accepted ones                                 (`update`)
    weights lookup          prompt lookup's token j by its measured hit rates: the first token's, then the
                            rate of a token given that the previous one was right (lookup is right in runs)
    backs off               to plain decoding while the measured seconds per token of speculating exceed plain
                            decoding's (4 cycles' evidence; then 8, 16, ... 64 plain cycles before trying again)

Drafting (tree.py: `build_tree`, `add_chain`, `cut_to_budget`) is kept apart from adapting (`ShapePolicy.update`), as
transformers keeps `get_candidates` apart from `update_candidate_strategy`. Fixed settings (`TreeSettings`) bypass
what they fix. This file ships inside every published drafter repo (custom_generate/): it imports only torch.
"""

import functools
import logging
import math
import time
from dataclasses import dataclass, field

import torch

__all__ = ["Costs", "ShapePolicy", "TreeSettings", "measure_costs", "VERIFY_SIZES", "STEP_WIDTHS"]

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
    _table: dict = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def _interp(table: dict[int, float], n: float) -> float:
        xs = sorted(table)
        if n <= xs[0]:
            return table[xs[0]]
        for a, b in zip(xs, xs[1:]):
            if n <= b:
                return table[a] + (table[b] - table[a]) * (n - a) / (b - a)
        a, b = xs[-2], xs[-1]
        return table[b] + (table[b] - table[a]) * (n - b) / (b - a)

    def verify_cost(self, n: int) -> float:
        return self._interp(self.verify, n)

    def verify_costs(self, limit: int) -> torch.Tensor:
        """[limit] float: verify_cost(n) for n = 1..limit, computed once per limit."""
        if limit not in self._table:
            self._table[limit] = torch.tensor([self.verify_cost(n) for n in range(1, limit + 1)])
        return self._table[limit]

    def step_cost(self, w: int) -> float:
        return self._interp(self.step, w)

    def as_dict(self) -> dict:
        return {"verify": dict(self.verify), "step": dict(self.step)}


def _best_time(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_costs(target, drafter, run, verify_sizes=VERIFY_SIZES, step_widths=STEP_WIDTHS) -> Costs:
    """Time the target verifying n dummy tokens per row on the run's cache (cropped back after each) and the drafter's
    tree step over w dummy nodes (forgotten after each), on this hardware, with this batch."""
    B = run.roots.shape[0]
    root = run.roots[:, None]  # [B, 1]

    def verify(n):
        ids = root.expand(B, n)  # [B, n]
        q_pos = run.root_pos[:, None] + torch.arange(n, device=ids.device)  # [B, n]
        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril().expand(B, n, n)
        run.target_forward(ids, q_pos, causal)
        run.cache.crop(-n)

    def step(w):
        ids = root.expand(B, w)  # [B, w]
        drafter.tree_step(run.draft_state, ids, run.root_pos[:, None].expand(B, w) + 1, torch.full_like(ids, -1))
        drafter.tree_end(run.draft_state)

    verify_t = {n: _best_time(functools.partial(verify, n)) for n in verify_sizes}
    step_t = {w: _best_time(functools.partial(step, w)) for w in step_widths}
    return Costs(verify=verify_t, step=step_t)


@dataclass
class Shape:
    """One cycle's plan: drafter steps (`depth`, 0: plain decoding), children per node (`top_k`), `widths`: the
    frontier per depth (a function of the newest scores, or None: top_k), `budget` (None: by expected tokens per
    second), `lookup`, and why (for the debug log)."""

    depth: int
    top_k: int
    widths: object = None
    budget: int | None = None
    lookup: bool = False
    why: str = ""


class ShapePolicy:
    """Chooses each cycle's shape (`plan`, `widths`, `cycle_seconds`, `lookup_log_probs`) and adapts from what the
    cycles measured (`update`). One per engine call; `batch` rows; `costs` as measured."""

    def __init__(self, settings: TreeSettings, costs: Costs, batch: int, lookup: bool):
        self.settings, self.costs, self.batch, self.lookup = settings, costs, batch, lookup
        self.step_s = costs.verify_cost(1)  # a plain decoding cycle of the batch: tracked from the plain cycles
        self.fixed_s = 0.0  # the speculative cycle's time beyond drafting and verifying (catch-up, loop): tracked
        self.plain_fixed_s = 0.0  # the same for a plain cycle
        self.spec_rate = None  # seconds per token of the batch while speculating, tracked over the current probe
        self.probe_cycles = 0
        self.gamma, self.predicted, self.realised = 1.0, 1.0, 1.0  # calibration of the drafter's probabilities
        self.backoff, self.plain_left = 8, 0  # plain cycles after speculation stopped paying
        self.look_first = [1.2, 2.0]  # lookup's first token: right / tried (a prior of 0.6)
        self.look_next = [1.6, 2.0]  # a lookup token given the previous one right: right / tried (a prior of 0.8)
        self.node_cost = max(costs.verify_cost(2) - costs.verify_cost(1), 1e-9)  # one more verified node (batch)
        self.chosen: dict[tuple, int] = {}  # (depth, verified nodes) -> cycles, for the call's debug summary

    # ----- drafting side: what to draft this cycle ----------------------------------------------------------------
    @property
    def token_s(self) -> float:
        """Seconds one more token of the batch is worth: the current seconds per token (speculating when known)."""
        return self.spec_rate if self.spec_rate is not None else self.step_s / self.batch

    def plan(self, remaining: int) -> Shape:
        """This cycle's shape; `remaining`: tokens the longest row may still generate."""
        s = self.settings
        if remaining <= 1 or s.budget == 0:
            return Shape(0, 1, why="no room for drafts" if remaining <= 1 else "budget 0")
        if s.automatic and self.plain_left > 0:
            self.plain_left -= 1
            return Shape(0, 1, why=f"backed off: speculating cost more per token than plain ({self.plain_left} left)")
        depth = min(s.depth or s.max_depth, remaining - 1)
        top_k = s.top_k or s.max_top_k
        widths = None
        if s.depth is None or s.top_k is None:
            widths = functools.partial(self._width, fixed_depth=s.depth is not None, fixed_k=s.top_k)
        return Shape(depth, top_k, widths, s.budget, bool(self.lookup), why="automatic" if s.automatic else "fixed")

    def _width(self, d: int, newest: torch.Tensor, fixed_depth: bool, fixed_k: int | None) -> int:
        """The frontier at depth d (0: stop drafting): the newest nodes whose path probability pays for verifying
        them (at least one), while the frontier's expected tokens pay for one more drafter step."""
        p = newest.exp()  # [B, c]
        k = min(fixed_k or self.settings.max_top_k, newest.shape[1])
        if fixed_k is None:  # columns of the batch's nodes, most probable first, that pay for their verification
            columns = p.sort(dim=-1, descending=True).values.sum(0)  # [c]
            k = max(1, min(k, int((columns * self.token_s > self.node_cost).sum())))
        if not fixed_depth:
            front = p.topk(k, dim=-1).values.sum()  # the batch's expected tokens below the frontier, at most
            if float(front) * self.token_s < self.costs.step_cost(k):
                return 0
        return k

    def cycle_seconds(self, limit: int, draft_s: float) -> torch.Tensor:
        """[limit+1]: the cycle's predicted seconds with n = 0..limit nodes verified."""
        return self.fixed_s + draft_s + self.costs.verify_costs(limit + 1)

    def lookup_log_probs(self, n: int) -> list[float]:
        """Estimated log probability that lookup's first j tokens are all right, j = 1..n."""
        first = math.log(min(0.95, max(0.05, self.look_first[0] / self.look_first[1])))
        nxt = math.log(min(0.98, max(0.05, self.look_next[0] / self.look_next[1])))
        return [first + j * nxt for j in range(n)]

    # ----- adapting side: what the cycle measured ------------------------------------------------------------------
    def update(self, tree, lengths: list, lookup_right: list, seconds: float, draft_s: float, verify_s: float):
        """After a cycle: `tree` verified, `lengths` [B] accepted drafts per row, `lookup_right` per row (tried,
        right) pairs for lookup's chain ((first tried, first right), (next tried, next right)), the cycle's wall
        `seconds` of which `draft_s` drafting and `verify_s` verifying."""
        tokens = sum(lengths) + len(lengths)
        if tree.size == 0:  # a plain cycle
            self.plain_fixed_s = 0.8 * self.plain_fixed_s + 0.2 * max(0.0, seconds - verify_s)
            self.step_s = 0.8 * self.step_s + 0.2 * verify_s
            return
        self.fixed_s = 0.8 * self.fixed_s + 0.2 * max(0.0, seconds - draft_s - verify_s)
        self.chosen[(int(tree.depth.max()), tree.size)] = self.chosen.get((int(tree.depth.max()), tree.size), 0) + 1
        for (ft, fr), (nt, nr) in lookup_right:
            self.look_first[0] += fr
            self.look_first[1] += ft
            self.look_next[0] += nr
            self.look_next[1] += nt
        # calibration: the expected accepted drafts (sum of the verified nodes' path probabilities) track the accepted
        expected = float(torch.where(tree.real, tree.score.exp(), 0.0).sum())
        self.predicted = 0.8 * self.predicted + 0.2 * expected
        self.realised = 0.8 * self.realised + 0.2 * sum(lengths)
        ratio = max(self.predicted, 1e-3) / max(self.realised, 1e-3)
        self.gamma = min(2.0, max(0.2, self.gamma * ratio**0.1))
        rate = seconds / tokens
        self.spec_rate = rate if self.spec_rate is None else 0.8 * self.spec_rate + 0.2 * rate
        self.probe_cycles += 1
        if not self.settings.automatic or self.probe_cycles < 4:
            return
        plain_rate = (self.step_s + self.plain_fixed_s) / len(lengths)
        if self.spec_rate > 1.05 * plain_rate:
            logger.debug(
                "backing off for %d cycles: %.1f ms per token speculating > %.1f ms plain",
                self.backoff, 1000 * self.spec_rate, 1000 * plain_rate,
            )  # fmt: skip
            self.plain_left, self.backoff = self.backoff, min(2 * self.backoff, 64)
            self.spec_rate, self.probe_cycles = None, 0
        else:
            self.backoff = 8

    def summary(self) -> dict:
        """What the policy chose and measured over the call (the debug log, `moa costs`)."""
        return {
            "shapes": {f"depth {d}, {n} nodes": c for (d, n), c in sorted(self.chosen.items())},
            "gamma": self.gamma,
            "lookup_first_right": self.look_first[0] / self.look_first[1],
            "lookup_next_right": self.look_next[0] / self.look_next[1],
            "fixed_ms": 1000 * self.fixed_s,
            "plain_step_ms": 1000 * self.step_s,
            "spec_ms_per_token": None if self.spec_rate is None else 1000 * self.spec_rate,
        }
