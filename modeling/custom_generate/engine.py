"""The speculative engine: dynamic draft trees, prompt lookup and the network verified together, batches.

One decoding loop for an unmodified transformers target and a drafter of this library (`MoADrafterModel`,
`EagleDrafterModel`), run through `target.generate(..., custom_generate=<callable>)` so transformers prepares what
`generate` users pass (logits processors, stopping criteria, generation config) and this loop does the rest:

    per cycle:  drafter catches up on the tokens verified last cycle   (one drafter call)
                per depth: the drafter runs once over the frontier      (EAGLE-2 dynamic tree, `build_tree`)
                prompt lookup's continuation joins the same tree        (`add_chain`)
                one target forward verifies the whole tree              (4-D tree mask, tree position ids)
                each row accepts its longest matching path              (`accept_path`: greedy or exact sampling)
                the accepted path's keys/values move into place         (`compact_cache`)

Tree shape: `TreeSettings` (depth, top-k, budget); what the user leaves open is chosen per cycle from the measured
costs of this hardware (`measure_costs`: the target's cost of verifying n tokens, the drafter's per depth) and the
drafter's own probabilities: the nodes verified are the ones whose path probability pays for their verification.

This folder ships inside every published drafter repo as transformers' `custom_generate/` (see `generate.py`), so
this file imports only torch and transformers.
"""

import contextlib
import functools
import itertools
import math
import time
from dataclasses import asdict, dataclass, field, replace

import torch
from transformers import DynamicCache, StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

__all__ = [
    "Costs",
    "EngineOutput",
    "EngineStats",
    "Tree",
    "TreeSettings",
    "accept_path",
    "add_chain",
    "build_tree",
    "compact_cache",
    "cut_to_budget",
    "measure_costs",
    "speculative_generate",
    "tree_attention_mask",
]

_NEG = -float("inf")
# transformers 5.24 renamed the cache argument `past_key_values` to `cache` (see `CACHE_NAME` in drafting.py; this
# file stands alone as custom_generate code, so it reads the installed name itself).
_CACHE_NAME = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


# ---------------------------------------------------------------------------------------------------------------------
# Settings, statistics, output
# ---------------------------------------------------------------------------------------------------------------------
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
class EngineStats:
    """What the engine did for one row. `accepted_lengths[i]`: tokens the row gained at target call i (its first
    token, from the prompt's forward, counts as a call of length 1; plain decoding = all ones)."""

    accepted_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)  # drafted nodes verified per speculative call
    drafted_tokens: int = 0
    lookup_tokens: int = 0  # drafted nodes proposed by prompt lookup only
    draft_time_s: float = 0.0  # the batch's times while this row was in it
    verify_time_s: float = 0.0
    exit_counts: list[int] = field(default_factory=list)  # drafted nodes per drafter exit (prompt lookup's not in it)

    @property
    def target_calls(self) -> int:
        return len(self.accepted_lengths)

    @property
    def generated_tokens(self) -> int:
        return sum(self.accepted_lengths)

    @property
    def mean_accepted_length(self) -> float:
        return self.generated_tokens / max(1, self.target_calls)

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(
            target_calls=self.target_calls,
            generated_tokens=self.generated_tokens,
            mean_accepted_length=self.mean_accepted_length,
        )
        return out


@dataclass
class EngineOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `speculation_stats`: one `EngineStats` per row, and `costs`: the `Costs` the
    tree shape was chosen from."""

    speculation_stats: list | None = None
    costs: "Costs | None" = None


# ---------------------------------------------------------------------------------------------------------------------
# Measured costs
# ---------------------------------------------------------------------------------------------------------------------
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
        """[limit] float: verify_cost(n) for n = 1..limit, computed once per limit (the budget cut reads it every
        cycle)."""
        if limit not in self._table:
            self._table[limit] = torch.tensor([self.verify_cost(n) for n in range(1, limit + 1)])
        return self._table[limit]

    def step_cost(self, w: int) -> float:
        return self._interp(self.step, w)

    def as_dict(self) -> dict:
        return {"verify": dict(self.verify), "step": dict(self.step)}


# Measured once per (target, drafter, device, dtype, batch size) and process: measuring takes about a second, and
# the same costs serve every later call (pass `costs=` to reuse or override them).
_COSTS: dict[tuple, Costs] = {}
VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)
STEP_WIDTHS = (1, 2, 4, 8)


def _best_time(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_costs(target, drafter, run: "_Run", verify_sizes=VERIFY_SIZES, step_widths=STEP_WIDTHS) -> Costs:
    """Time the target verifying n dummy tokens per row on the run's cache (cropped back after each) and the drafter's
    tree step over w dummy nodes (forgotten after each), on this hardware, with this batch."""
    B, S = run.slot_valid.shape
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


# ---------------------------------------------------------------------------------------------------------------------
# The draft tree
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Tree:
    """Drafted nodes per row, parents before children. tokens/parents/depth: [B, N] (parent -1 = the root, the row's
    last verified token); score: [B, N] log of the path's drafter probability (for lookup nodes an estimate);
    real: [B, N] False for fillers that only pad rows to one size; lookup: [B, N] proposed by prompt lookup only;
    exit: [B, N] the drafter exit (1-based) whose evaluation proposed the node (0 for lookup nodes and fillers;
    None: all at exit 1)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    score: torch.Tensor
    real: torch.Tensor
    lookup: torch.Tensor
    exit: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def select(self, keep: torch.Tensor) -> "Tree":
        """The nodes `keep` [B, n] (indices in parents-first order, ancestor-closed), parents renumbered."""
        B, N = self.tokens.shape
        new_index = torch.full((B, N + 1), -1, dtype=torch.long, device=keep.device)  # old -> new, col N: root
        new_index[:, :N].scatter_(1, keep, torch.arange(keep.shape[1], device=keep.device).expand_as(keep))
        old_parents = self.parents.gather(1, keep)  # [B, n]
        parents = new_index.gather(1, torch.where(old_parents < 0, N, old_parents))  # root stays -1
        return Tree(
            tokens=self.tokens.gather(1, keep),
            parents=parents,
            depth=self.depth.gather(1, keep),
            score=self.score.gather(1, keep),
            real=self.real.gather(1, keep),
            lookup=self.lookup.gather(1, keep),
            exit=None if self.exit is None else self.exit.gather(1, keep),
        )

    def exit_counts(self, num_exits: int) -> list:
        """Per row, the real nodes the drafter's network proposed at each exit ([B][num_exits])."""
        exit = torch.ones_like(self.tokens) if self.exit is None else self.exit
        network = self.real & ~self.lookup  # [B, N]
        counts = torch.nn.functional.one_hot(exit.clamp(0, num_exits), num_exits + 1)[..., 1:]  # [B, N, K]
        return (counts * network[..., None]).sum(1).tolist()


def _ancestors(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """bool [B, N, N]: node j is node i itself or one of its ancestors (parents [B, N], -1 = root), by pointer
    doubling: log2(depth) batched matrix products."""
    B, N = parents.shape
    eye = torch.eye(N, dtype=torch.bool, device=parents.device).expand(B, N, N)
    parent_of = torch.zeros(B, N, N + 1, dtype=torch.bool, device=parents.device)
    parent_of.scatter_(2, torch.where(parents < 0, N, parents)[..., None], True)
    anc = eye | parent_of[..., :N]  # [B, N, N]: itself and its parent
    reach = 1
    while reach < max_depth:
        anc = anc | (anc.float() @ anc.float()).bool()  # paths of length <= 2 * reach
        reach *= 2
    return anc


def build_tree(
    drafter, state, root_logits, root_pos, settings: TreeSettings, costs: Costs, sec_per_token: float, gamma=1.0
):
    """EAGLE-2's dynamic tree. Per depth the drafter runs once over the frontier (the most probable nodes of the
    newest depth by path probability); each frontier node proposes its top-k children; every proposal is a candidate.
    Returns every candidate as a `Tree` (parents first; `cut_to_budget` picks the ones to verify).

    Open settings are chosen from the costs: the frontier keeps the nodes whose path probability pays for verifying
    them, and the next depth is drafted only while the frontier's path probabilities can pay for a drafter step.
    `gamma` calibrates the drafter's probabilities to what the target accepts: a node's score is gamma times its
    path log-probability (gamma < 1: the drafter is underconfident)."""
    B, device = root_logits.shape[0], root_logits.device
    k = settings.top_k or settings.max_top_k
    max_depth = settings.depth or settings.max_depth
    node_cost = max(costs.verify_cost(2) - costs.verify_cost(1), 1e-9)  # one more verified node for the batch
    score, tokens = root_logits.float().log_softmax(-1).topk(k, dim=-1)  # [B, k] children of the root
    score = gamma * score
    parts = {"tokens": [tokens], "parents": [torch.full_like(tokens, -1)], "depth": [torch.ones_like(tokens)]}
    parts["score"] = [score]
    root_exits = getattr(state, "root_exits", None)  # a sorted drafter's exit per evaluation; else all exit 1
    parts["exit"] = [torch.ones_like(tokens) if root_exits is None else root_exits[:, None].expand(B, k)]
    fed_number = [torch.full_like(tokens, -1)]  # per candidate: its number among the nodes fed to the drafter
    first, fed = 0, 0  # index of the newest depth's first candidate; nodes fed so far
    for d in range(1, max_depth):
        newest_score = parts["score"][-1]  # [B, c]
        width = k
        if settings.top_k is None:  # the nodes worth verifying, at least one
            worth = (newest_score.exp() * (sec_per_token * B) > node_cost).sum(-1).max()
            width = max(1, min(k, int(worth)))
        front_score, front = newest_score.topk(min(width, newest_score.shape[1]), dim=-1)  # [B, w]
        w = front.shape[1]
        if settings.depth is None and float(front_score.exp().sum()) * sec_per_token < costs.step_cost(w):
            break  # the whole frontier's expected tokens cannot pay for one more drafter step
        front_ids = front + first  # [B, w] candidate indices
        all_parents, all_numbers = torch.cat(parts["parents"], 1), torch.cat(fed_number, 1)  # [B, count]
        parent = all_parents.gather(1, front_ids)  # [B, w]: candidate index of each frontier node's parent, or -1
        parent_number = torch.where(parent < 0, parent, all_numbers.gather(1, parent.clamp_min(0)))  # [B, w]
        front_tokens = parts["tokens"][-1].gather(1, front)  # [B, w]
        logits = drafter.tree_step(state, front_tokens, root_pos[:, None].expand(B, w) + d, parent_number)  # [B,w,V]
        fed_number[-1] = fed_number[-1].scatter(1, front, torch.arange(fed, fed + w, device=device).expand(B, w))
        fed += w
        child_score, child_tokens = logits.float().log_softmax(-1).topk(k, dim=-1)  # [B, w, k]
        first = sum(t.shape[1] for t in parts["tokens"])
        parts["tokens"].append(child_tokens.reshape(B, w * k))  # [B, w*k]
        parts["parents"].append(front_ids[..., None].expand(B, w, k).reshape(B, w * k))
        parts["depth"].append(torch.full((B, w * k), d + 1, dtype=torch.long, device=device))
        parts["score"].append((gamma * child_score + front_score[..., None]).reshape(B, w * k))
        node_exits = getattr(state, "node_exits", None)  # [B, w]
        exits = torch.ones_like(front) if node_exits is None else node_exits
        parts["exit"].append(exits[..., None].expand(B, w, k).reshape(B, w * k))
        fed_number.append(torch.full((B, w * k), -1, dtype=torch.long, device=device))
    tree = {name: torch.cat(values, dim=1) for name, values in parts.items()}
    real = torch.ones_like(tree["tokens"], dtype=torch.bool)
    return Tree(**tree, real=real, lookup=~real)


def add_chain(tree: Tree, chains: list, log_prob: float) -> Tree:
    """Add one chain of tokens per row under the root (prompt lookup's continuation; None: none for that row).
    Where a prefix of it is already in the tree it follows those nodes (raising their score to the chain's), the rest
    becomes new nodes after the existing ones. Chain token j (1-based) scores j * log_prob (the estimated log
    probability that lookup's first j tokens are all right). Rows are padded to one size with fillers."""
    B = tree.tokens.shape[0]
    rows = []
    for b in range(B):
        exits = torch.ones_like(tree.tokens) if tree.exit is None else tree.exit
        cols = [t[b].tolist() for t in (tree.tokens, tree.parents, tree.depth, tree.score, tree.real, tree.lookup)]
        cols.append(exits[b].tolist())
        toks, pars, deps, scores, real, look, _ = cols
        chain = chains[b]
        if chain is not None and len(chain):
            child = {(p, t): i for i, (t, p) in reversed(list(enumerate(zip(toks, pars))))}
            node = -1
            for j, t in enumerate(chain.tolist() if torch.is_tensor(chain) else chain, start=1):
                i = child.get((node, t))
                if i is None:
                    i = len(toks)
                    for col, value in zip(cols, (t, node, j, j * log_prob, True, True, 0)):
                        col.append(value)
                    child[(node, t)] = i
                else:
                    scores[i] = max(scores[i], j * log_prob)
                node = i
        rows.append(cols)
    size = max(len(r[0]) for r in rows)
    for cols in rows:  # fillers: children of the root that are never accepted (real False) and never chosen
        for col, value in zip(cols, (0, -1, 1, _NEG, False, False, 0)):
            col.extend([value] * (size - len(col)))
    device = tree.tokens.device
    dtypes = (torch.long, torch.long, torch.long, torch.float32, torch.bool, torch.bool, torch.long)
    tensors = [torch.tensor([r[i] for r in rows], dtype=dt, device=device) for i, dt in enumerate(dtypes)]
    return Tree(*tensors)


def cut_to_budget(tree: Tree, budget: int | None, max_budget: int, costs: Costs, draft_s: float) -> Tree:
    """The nodes to verify: the n most probable (by path probability; a prefix of that order is a tree, as a child
    is never likelier than its parent and ties keep parents first), n = `budget`, or with budget None the n that
    maximises expected tokens per second, sum over rows of (1 + sum of path probabilities) / (draft + verify(n+1))."""
    score, order = tree.score.sort(dim=-1, descending=True, stable=True)  # [B, N]
    N = score.shape[1]
    if budget is not None:
        n = min(budget, N)
    else:
        limit = min(N, max_budget)
        gain = torch.cat([score.new_zeros(1), score[:, :limit].exp().sum(0).cumsum(0)])  # [limit+1]: n = 0..limit
        gain = gain + score.shape[0]  # each row's own (bonus or correction) token
        seconds = draft_s + costs.verify_costs(limit + 1)  # [limit+1]: verifying n drafts and the root
        n = int((gain / seconds).argmax())
    keep = order[:, :n].sort(dim=-1).values  # [B, n] parents first again
    return tree.select(keep)


# ---------------------------------------------------------------------------------------------------------------------
# Acceptance
# ---------------------------------------------------------------------------------------------------------------------
def accept_path(tokens: list, parents: list, real: list, scores_at, do_sample: bool, generator=None):
    """One row's accepted path through a verified tree and the target's next token: (node indices, token).

    `scores_at(node, path)`: the target's processed scores [V] after the node (-1: the root) given the accepted
    path's nodes. Greedy: follow the child equal to the argmax while there is one. Sampling with deterministic drafts
    (each child's draft probability is one): visit the distinct children in order; accept child x with probability
    p(x) / (mass not yet removed); on a rejection remove x from p; when every child was rejected, sample from what
    is left. Each emitted token then follows the target's p exactly (see docs/design.md)."""
    children: dict[int, list[int]] = {}
    for i, (p, r) in enumerate(zip(parents, real)):
        if r:
            children.setdefault(p, []).append(i)
    node, path = -1, []
    while True:
        scores = scores_at(node, path)  # [V]
        kids = children.get(node, ())
        if not do_sample:
            best = int(scores.argmax())
            nxt = next((c for c in kids if tokens[c] == best), None)
            if nxt is None:
                return path, best
        else:
            p = scores.float().softmax(-1)
            nxt = None
            for c in kids:
                x = tokens[c]
                mass, px = float(p.sum()), float(p[x])
                if px > 0 and float(torch.rand((), generator=generator, device=p.device)) * mass < px:
                    nxt = c
                    break
                p[x] = 0.0
            if nxt is None:
                if not float(p.sum()) > 0:  # rounding left no mass: the target's own distribution
                    p = scores.float().softmax(-1)
                return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(nxt)
        node = nxt


# ---------------------------------------------------------------------------------------------------------------------
# Target-side tensors: masks, cache compaction
# ---------------------------------------------------------------------------------------------------------------------
def tree_attention_mask(slot_valid, slot_pos, q_pos, q_visible, window: int | None = None) -> torch.Tensor:
    """bool [B, 1, Q, S+Q] (True = attend) for Q new tokens on top of S cached slots.

    slot_valid/slot_pos [B, S]: which cache slots hold a verified token of the row, at which position; q_pos [B, Q]
    the new tokens' positions; q_visible bool [B, Q, Q] which new tokens each new token sees (the tree's
    ancestors-or-self; causal for a prompt). A sliding-window layer sees positions within `window` only (q - k < w,
    as transformers' sliding mask)."""
    B, Q = q_pos.shape
    past = slot_valid[:, None, :].expand(B, Q, slot_valid.shape[1])  # [B, Q, S]
    new = q_visible
    if window is not None:
        past = past & ((q_pos[:, :, None] - slot_pos[:, None, :]) < window)
        new = new & ((q_pos[:, :, None] - q_pos[:, None, :]) < window)
    return torch.cat([past, new], dim=-1)[:, None]  # [B, 1, Q, S+Q]


def compact_cache(cache, start: int, keep: torch.Tensor) -> None:
    """Move each row's kept new slots to the front of the new region: slots start + keep[b, j] -> start + j, then
    drop the rest (keep [B, K] indices into the slots added since `start`; padding entries repeat index 0)."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            states = getattr(layer, name)  # [B, H, S, D]
            B, H, _, D = states.shape
            idx = (start + keep)[:, None, :, None].expand(B, H, keep.shape[1], D)  # [B, H, K, D]
            moved = states.gather(2, idx)
            states[:, :, start : start + keep.shape[1]] = moved
            setattr(layer, name, states[:, :, : start + keep.shape[1]])


def _layer_windows(config) -> dict[str, int | None]:
    """{layer type: its window (None: full attention)} of a target config, as transformers' masks read it. (The
    drafter config's `target_layer_types` reads the same fields; this file ships alone in `custom_generate/`, so it
    cannot import it.)"""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        sliding = window is not None and getattr(cfg, "use_sliding_window", True) is not False
        types = ["sliding_attention" if sliding else "full_attention"]
    out = {}
    for kind in set(types):
        if kind == "full_attention":
            out[kind] = None
        elif kind == "sliding_attention":
            out[kind] = window
        else:
            raise ValueError(
                f"The speculative engine builds full and sliding-window attention masks; this target has "
                f"'{kind}' layers. Use `target.generate(..., assistant_model=drafter)` for it."
            )
    return out


# ---------------------------------------------------------------------------------------------------------------------
# One generate call
# ---------------------------------------------------------------------------------------------------------------------
class _Run:
    """The state of one engine call over a (left-padded) batch. Rows that finish leave the batch.

    Target cache: a `DynamicCache` of full layers (sliding windows are applied by the masks), slot s of row b holds
    a verified token at position `slot_pos[b, s]` where `slot_valid[b, s]` (left padding and rows that accepted fewer
    tokens than others leave invalid slots). The row's newest token (`roots`) has no target state yet. `pending`:
    per row the verified tokens the drafter has not seen, as (token, position, slot of the previous token's state).
    """

    def __init__(self, target, drafter, input_ids, attention_mask, gc, processors, stopping, settings, streamer):
        self.target, self.drafter, self.gc, self.settings, self.streamer = target, drafter, gc, settings, streamer
        self.processors, self.stopping = processors, stopping
        self.windows = _layer_windows(target.config)
        impl = getattr(target.config, "_attn_implementation", "sdpa")
        if impl not in ("sdpa", "eager"):
            raise ValueError(
                f"The speculative engine passes a 4-D tree mask, which the '{impl}' attention cannot take. Load the "
                "target with attn_implementation='sdpa' (or 'eager')."
            )
        self.additive = impl == "eager"
        self.needs_hidden = bool(getattr(drafter, "needs_target_hidden", False))
        B, P = input_ids.shape
        device = input_ids.device
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        self.rows = list(range(B))  # original row index of each active row
        self.seqs = [input_ids[b] for b in range(B)]  # padded prompt + new tokens, per active row
        self.prompt_len = P
        self.done: dict[int, torch.Tensor] = {}
        self.stats = [EngineStats() for _ in range(B)]
        self.cache = DynamicCache()
        self.slot_valid = mask  # [B, P]
        self.slot_pos = (mask.long().cumsum(-1) - 1).clamp_min(0)  # [B, P]
        self.slot_hidden = None  # [B, S, d] the target's final hidden state per slot, for drafters that read it
        self.pad = gc.pad_token_id if gc.pad_token_id is not None else _first(gc.eos_token_id, 0)
        eos = gc.eos_token_id
        self.eos = torch.tensor([eos] if isinstance(eos, int) else (eos or []), dtype=torch.long, device=device)
        self.draft_state = drafter.tree_start(B)
        self.pending = [[] for _ in range(B)]
        self.roots = torch.zeros(B, dtype=torch.long, device=device)
        self.root_pos = torch.zeros(B, dtype=torch.long, device=device)
        self.costs: Costs | None = None
        self.sec_per_token = None  # seconds per token of plain decoding (measured, then tracked): a token's worth
        self.spec_sec_per_token, self.probe_cycles = None, 0  # the same while speculating, over this probe's cycles
        self.gamma, self.predicted, self.realised = 1.0, 1.0, 1.0  # calibration of the drafter's probabilities
        self.backoff, self.plain_left = 8, 0  # plain cycles after speculation stopped paying (automatic shape only)
        self.lookup = settings.lookup
        if self.lookup is None:
            self.lookup = getattr(drafter, "lookup_settings", None) is not None
        self.lookup_log_prob = math.log(0.6)  # estimate of a lookup token being right; updated from what verifies
        self.lookup_seen, self.lookup_hit = 2.0, 1.2

    # ----- the target ---------------------------------------------------------------------------------------------
    def target_forward(self, ids, q_pos, q_visible, logits_to_keep: int = 0):
        """One target forward of new tokens ids [B, Q] at positions q_pos [B, Q] seeing q_visible [B, Q, Q] among
        themselves and every valid cached slot; returns the model output (its cache grows by Q slots)."""
        masks = {}
        for kind, window in self.windows.items():
            m = tree_attention_mask(self.slot_valid, self.slot_pos, q_pos, q_visible, window)  # [B, 1, Q, S+Q]
            if self.additive:
                dtype = self.target.dtype
                m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
            masks[kind] = m
        attention_mask = masks if len(masks) > 1 else next(iter(masks.values()))
        return self.target(
            input_ids=ids,
            attention_mask=attention_mask,
            position_ids=q_pos,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=self.needs_hidden,
            **{_CACHE_NAME: self.cache},
        )

    def prefill(self) -> None:
        """The prompt's forward and the first new token of every row."""
        ids = torch.stack(self.seqs)  # [B, P]
        B, P = ids.shape
        valid, pos = self.slot_valid, self.slot_pos
        self.slot_valid = valid[:, :0]
        self.slot_pos = pos[:, :0]
        causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()
        eye = torch.eye(P, dtype=torch.bool, device=ids.device)
        visible = (causal & valid[:, None, :]) | eye  # [B, P, P]; padding sees itself (no empty softmax row)
        t0 = time.perf_counter()
        out = self.target_forward(ids, pos, visible, logits_to_keep=1)
        self.slot_valid, self.slot_pos = valid, pos
        if self.needs_hidden:
            self.slot_hidden = out.hidden_states[-1]  # [B, P, d]
        scores = self.processors(ids, out.logits[:, -1].float())  # [B, V]
        if self.gc.do_sample:
            first = torch.multinomial(scores.softmax(-1), 1)[:, 0]
        else:
            first = scores.argmax(-1)  # [B]
        seconds = time.perf_counter() - t0
        for b in range(B):
            self.stats[b].verify_time_s += seconds
            cols = valid[b].nonzero()[:, 0].tolist()
            prev = [c - 1 if c > 0 and valid[b, c - 1] else -1 for c in cols]
            self.pending[b] = list(zip(ids[b, cols].tolist(), pos[b, cols].tolist(), prev))
        self.emit([[t] for t in first.tolist()], pos[:, -1] + 1, slots_from=P - 1)

    # ----- bookkeeping after each target call -----------------------------------------------------------------------
    def emit(self, new_tokens: list, first_pos: torch.Tensor, slots_from: int) -> None:
        """Append each row's new tokens (accepted drafts, then the target's token) at positions first_pos [B] on,
        stop rows that are done, queue the tokens for the drafter (`slots_from`: the cache slot of the state of the
        first new token's predecessor; the following ones sit in the slots after it)."""
        finished = []
        for i, toks in enumerate(new_tokens):
            b = self.rows[i]
            seq = self.seqs[i]
            for j in range(len(toks)):  # the first token that satisfies a stopping criterion ends the row
                cand = torch.cat([seq, torch.tensor(toks[: j + 1], dtype=seq.dtype, device=seq.device)])
                if bool(self.stopping(cand[None], None)[0]):
                    toks = toks[: j + 1]
                    finished.append(i)
                    break
            self.seqs[i] = torch.cat([seq, torch.tensor(toks, dtype=seq.dtype, device=seq.device)])
            self.stats[b].accepted_lengths.append(len(toks))
            pos0 = int(first_pos[i])
            self.pending[i] += [(t, pos0 + j, slots_from + j) for j, t in enumerate(toks)]
            if self.streamer is not None:
                self.streamer.put(torch.tensor(toks))
        self.roots = torch.tensor([toks[-1] for toks in new_tokens], device=self.roots.device)
        self.root_pos = first_pos + torch.tensor([len(t) for t in new_tokens], device=first_pos.device) - 1
        if finished:
            self.finish(finished)

    def finish(self, rows: list) -> None:
        """Rows `rows` (active indices) are done: keep their sequences, drop them from every batched tensor."""
        for i in rows:
            self.done[self.rows[i]] = self.seqs[i]
        keep = [i for i in range(len(self.rows)) if i not in set(rows)]
        if not keep:
            self.rows = []
            return
        index = torch.tensor(keep, device=self.roots.device)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.slot_valid, self.slot_pos = self.slot_valid[index], self.slot_pos[index]
        if self.slot_hidden is not None:
            self.slot_hidden = self.slot_hidden[index]
        self.roots, self.root_pos = self.roots[index], self.root_pos[index]
        self.drafter.tree_select_rows(self.draft_state, index)
        self.rows = [self.rows[i] for i in keep]
        self.seqs = [self.seqs[i] for i in keep]
        self.pending = [self.pending[i] for i in keep]

    # ----- one cycle ------------------------------------------------------------------------------------------------
    def catch_up(self) -> torch.Tensor:
        """The drafter reads every verified token it has not seen; logits [B, V] after each row's root."""
        n = max(len(p) for p in self.pending)
        B, device = len(self.pending), self.roots.device
        tokens = torch.zeros(B, n, dtype=torch.long)
        positions = torch.zeros(B, n, dtype=torch.long)
        prev = torch.full((B, n), -1, dtype=torch.long)
        valid = torch.zeros(B, n, dtype=torch.bool)
        for b, items in enumerate(self.pending):
            if items:
                t, p, s = zip(*items)
                tokens[b, n - len(items) :] = torch.tensor(t)
                positions[b, n - len(items) :] = torch.tensor(p)
                prev[b, n - len(items) :] = torch.tensor(s)
                valid[b, n - len(items) :] = True
        tokens, positions, prev, valid = (x.to(device) for x in (tokens, positions, prev, valid))
        hidden = None
        if self.needs_hidden:
            hidden = self.slot_hidden.gather(
                1, prev.clamp_min(0)[..., None].expand(-1, -1, self.slot_hidden.shape[-1])
            )
            hidden = hidden * (prev >= 0)[..., None].to(hidden.dtype)  # [B, n, d]
        self.pending = [[] for _ in range(B)]
        return self.drafter.tree_catch_up(self.draft_state, tokens, positions, valid, prev, self.cache, hidden)

    def draft(self, root_logits: torch.Tensor) -> tuple[Tree, float]:
        """This cycle's tree (cut to the budget) and the time it took to draft."""
        t0 = time.perf_counter()
        remaining = self.gc.max_length - max(s.shape[0] for s in self.seqs)  # tokens still to generate, at most
        settings = self.settings
        if remaining <= 1:
            settings = TreeSettings(depth=1, top_k=1, budget=0, lookup=False)
        elif (settings.depth or settings.max_depth) >= remaining:
            cap = remaining - 1
            settings = replace(settings, depth=settings.depth and min(settings.depth, cap), max_depth=cap)
        tree = build_tree(
            self.drafter,
            self.draft_state,
            root_logits,
            self.root_pos,
            settings,
            self.costs,
            self.sec_per_token,
            self.gamma,
        )
        if self.lookup and settings.budget != 0:
            chains = [self.lookup_chain(i, remaining) for i in range(len(self.rows))]
            if any(c is not None for c in chains):
                tree = add_chain(tree, chains, self.lookup_log_prob)
        self.drafter.tree_end(self.draft_state)
        draft_s = time.perf_counter() - t0
        tree = cut_to_budget(tree, settings.budget, settings.max_budget, self.costs, draft_s)
        return tree, time.perf_counter() - t0

    def lookup_chain(self, i: int, remaining: int):
        ids = self.seqs[i][self.prompt_len - int(self.slot_valid[i, : self.prompt_len].sum()) :]  # row without padding
        return self.drafter.lookup_proposal(ids[None], max(1, remaining - 1), 0, self.eos)

    def verify(self, tree: Tree):
        """One target forward over [root, tree]: logits [B, 1+N, V] (and the final hidden states if needed)."""
        B, N = tree.tokens.shape
        device = tree.tokens.device
        ids = torch.cat([self.roots[:, None], tree.tokens], dim=1)  # [B, 1+N]
        q_pos = torch.cat([self.root_pos[:, None], self.root_pos[:, None] + tree.depth], dim=1)  # [B, 1+N]
        visible = torch.zeros(B, 1 + N, 1 + N, dtype=torch.bool, device=device)
        visible[:, :, 0] = True  # everyone sees the root
        visible[:, 1:, 1:] = _ancestors(tree.parents, int(tree.depth.max()) if N else 1)
        return self.target_forward(ids, q_pos, visible)

    def cycle(self) -> None:
        t0 = time.perf_counter()
        speculate = self.plain_left == 0
        root_logits = self.catch_up() if speculate else None
        if self.costs is None:
            t_measure = time.perf_counter()
            self.costs = _costs_for(self)
            t0 += time.perf_counter() - t_measure  # the cycle's own time excludes the measurement
        if self.sec_per_token is None:
            self.sec_per_token = self.costs.verify_cost(1) / len(self.rows)
        if speculate:
            tree, draft_s = self.draft(root_logits)
        else:
            self.plain_left -= 1
            tree, draft_s = _empty_tree(len(self.rows), self.roots.device), 0.0
        t1 = time.perf_counter()
        start = self.slot_valid.shape[1]
        out = self.verify(tree)
        logits = out.logits  # [B, 1+N, V]
        hidden = out.hidden_states[-1] if self.needs_hidden else None
        paths, new_tokens = self.accept(tree, logits)
        verify_s = time.perf_counter() - t1
        # the accepted path's states move next to the root's: slots start (root), start+1.. (accepted drafts)
        A = max(len(p) for p in paths)
        keep = torch.zeros(len(paths), 1 + A, dtype=torch.long)
        for i, path in enumerate(paths):
            keep[i, 1 : 1 + len(path)] = torch.tensor(path, dtype=torch.long) + 1
        keep = keep.to(self.roots.device)
        compact_cache(self.cache, start, keep)
        lengths = torch.tensor([len(p) for p in paths], device=keep.device)
        j = torch.arange(1 + A, device=keep.device)
        self.slot_valid = torch.cat([self.slot_valid, j[None, :] <= lengths[:, None]], dim=1)
        self.slot_pos = torch.cat([self.slot_pos, self.root_pos[:, None] + j[None, :]], dim=1)
        if hidden is not None:
            self.slot_hidden = torch.cat(
                [self.slot_hidden, hidden.gather(1, keep[..., None].expand(-1, -1, hidden.shape[-1]))], 1
            )
        tokens_now = 0
        exits = tree.exit_counts(getattr(self.drafter, "num_exits", 1))  # [B][K]: drafted nodes per exit
        for i, b in enumerate(self.rows):
            s = self.stats[b]
            s.exit_counts = [x + y for x, y in itertools.zip_longest(s.exit_counts, exits[i], fillvalue=0)]
            s.tree_sizes.append(int(tree.real[i].sum()))
            s.drafted_tokens += int(tree.real[i].sum())
            s.lookup_tokens += int(tree.lookup[i].sum())
            s.draft_time_s += draft_s
            s.verify_time_s += verify_s
            tokens_now += len(new_tokens[i])
        self.learn_lookup(tree, paths)
        self.calibrate(tree, paths)
        self.emit(new_tokens, self.root_pos + 1, slots_from=start)
        self.adapt(time.perf_counter() - t0, tokens_now, speculate)

    def accept(self, tree: Tree, logits: torch.Tensor):
        """Per row: the accepted path (node indices) and the new tokens (the path's tokens, then the target's)."""
        tokens, parents, real = tree.tokens.tolist(), tree.parents.tolist(), tree.real.tolist()
        plain_greedy = not self.gc.do_sample and len(self.processors) == 0
        argmax = logits.argmax(-1).tolist() if plain_greedy else None  # [B, 1+N]
        paths, new_tokens = [], []
        for i in range(len(self.rows)):
            if plain_greedy:

                def scores_at(node, path, i=i):
                    return _OneHot(argmax[i][node + 1])

            else:

                def scores_at(node, path, i=i):
                    ids = torch.cat([self.seqs[i], tree.tokens[i, path]]) if path else self.seqs[i]
                    return self.process(i, ids, logits[i, node + 1])

            path, nxt = accept_path(tokens[i], parents[i], real[i], scores_at, self.gc.do_sample)
            paths.append(path)
            new_tokens.append([tokens[i][c] for c in path] + [nxt])
        return paths, new_tokens

    def process(self, i: int, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The logits processors on active row i: scores [V] after its sequence ids [L]. The processors were built
        for the whole batch (some keep per-row state, e.g. the repetition penalty's padding lengths), so they see
        a batch of the original size in which every row is row i, and row i's result is kept."""
        b, B = self.rows[i], len(self.stats)
        scores = self.processors(ids[None].expand(B, -1), logits.float()[None].repeat(B, 1))  # [B, V]
        return scores[b]

    def learn_lookup(self, tree: Tree, paths: list) -> None:
        """Update the estimate of a lookup token being right from the lookup-only nodes just verified."""
        if not bool(tree.lookup.any()):
            return
        look = tree.lookup.tolist()
        for i, path in enumerate(paths):
            proposed = sum(look[i])
            accepted = sum(1 for c in path if look[i][c])
            # a lookup node is tried when its parent was accepted: count the tried ones
            tried = min(proposed, accepted + 1)
            self.lookup_seen += tried
            self.lookup_hit += accepted
        self.lookup_log_prob = math.log(min(0.95, max(0.05, self.lookup_hit / self.lookup_seen)))

    def calibrate(self, tree: Tree, paths: list) -> None:
        """Fit `gamma` (node score = gamma x path log-probability) so that the expected accepted drafts, the sum of
        the verified nodes' probabilities, tracks the accepted drafts (running averages; small steps)."""
        if tree.size == 0:
            return
        expected = float(torch.where(tree.real, tree.score.exp(), 0.0).sum())
        self.predicted = 0.8 * self.predicted + 0.2 * expected
        self.realised = 0.8 * self.realised + 0.2 * sum(len(p) for p in paths)
        ratio = max(self.predicted, 1e-3) / max(self.realised, 1e-3)
        self.gamma = min(2.0, max(0.2, self.gamma * ratio**0.1))

    def adapt(self, seconds: float, tokens: int, speculated: bool) -> None:
        """Track seconds per token of speculative and of plain cycles. With an automatic shape, when speculating
        has been slower than plain decoding over 4 cycles or more, decode plainly for a while (8 cycles, twice as
        long after each further failure, at most 64), then try again."""
        rate = seconds / max(1, tokens)
        if not speculated:
            self.sec_per_token = 0.8 * self.sec_per_token + 0.2 * rate
            return
        previous = self.spec_sec_per_token
        self.spec_sec_per_token = rate if previous is None else 0.8 * previous + 0.2 * rate
        self.probe_cycles += 1
        if not self.settings.automatic or not self.rows or self.probe_cycles < 4:
            return
        if self.spec_sec_per_token > 1.05 * self.sec_per_token:
            self.plain_left, self.backoff = self.backoff, min(2 * self.backoff, 64)
            self.spec_sec_per_token, self.probe_cycles = None, 0
        else:
            self.backoff = 8

    def output(self):
        for i, b in enumerate(self.rows):
            self.done[b] = self.seqs[i]
        seqs = [self.done[b] for b in range(len(self.stats))]
        length = max(s.shape[0] for s in seqs)
        out = torch.full((len(seqs), length), self.pad, dtype=seqs[0].dtype, device=seqs[0].device)
        for b, s in enumerate(seqs):
            out[b, : s.shape[0]] = s
        if self.streamer is not None:
            self.streamer.end()
        if not self.gc.return_dict_in_generate:
            return out
        return EngineOutput(sequences=out, speculation_stats=self.stats, costs=self.costs)


class _OneHot:
    """Stands for a row of scores whose argmax is known (greedy without logits processors)."""

    def __init__(self, index: int):
        self.index = index

    def argmax(self):
        return self.index


def _first(value, default):
    if isinstance(value, (list, tuple)):
        return value[0] if value else default
    return default if value is None else value


def _empty_tree(B: int, device) -> Tree:
    z = torch.zeros(B, 0, dtype=torch.long, device=device)
    return Tree(tokens=z, parents=z, depth=z, score=z.float(), real=z.bool(), lookup=z.bool())


def _costs_for(run: _Run) -> Costs:
    target, drafter = run.target, run.drafter
    key = (
        getattr(target.config, "name_or_path", ""),
        target.config.get_text_config().hidden_size,
        str(target.device),
        str(target.dtype),
        len(run.rows),
        type(drafter).__name__,
        drafter.config.hidden_size,
        str(drafter.dtype),
    )
    if key not in _COSTS:
        _COSTS[key] = measure_costs(target, drafter, run)
    return _COSTS[key]


@torch.no_grad()
def _decode(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    *,
    engine_drafter=None,
    engine_settings=None,
    engine_streamer=None,
    engine_costs=None,
    **model_kwargs,
):
    """The loop `target.generate` runs with `custom_generate=` (it prepared processors, criteria and config)."""
    gc = generation_config
    if gc.num_beams > 1 or gc.num_return_sequences > 1:
        raise ValueError(
            "The speculative engine decodes one sequence per prompt: use num_beams=1, num_return_sequences=1."
        )
    for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(gc, flag, False):
            raise ValueError(f"The speculative engine does not return `{flag}`; call `target.generate` without it.")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("The speculative engine builds its own cache: do not pass a filled cache.")
    run = _Run(
        model,
        engine_drafter,
        input_ids,
        model_kwargs.get("attention_mask"),
        gc,
        logits_processor,
        stopping_criteria,
        engine_settings,
        engine_streamer,
    )
    run.costs = engine_costs
    run.prefill()
    while run.rows:
        run.cycle()
    return run.output()


def speculative_generate(
    target,
    drafter,
    *args,
    tree_depth: int | None = None,
    tree_top_k: int | None = None,
    tree_budget: int | None = None,
    lookup: bool | None = None,
    costs: Costs | None = None,
    allow_other_target: bool = False,
    streamer=None,
    **kwargs,
):
    """`target.generate(*args, **kwargs)` decoded by the speculative engine with `drafter`: the same tokens as plain
    greedy decoding (the same distribution when sampling), in fewer target calls.

    Takes what `generate` takes (input_ids, attention_mask of a left-padded batch, max/min_new_tokens, eos and stop
    strings with `tokenizer=`, logits processors, do_sample/temperature/top_k/top_p, streamer for batch 1,
    return_dict_in_generate) plus the tree's shape: `tree_depth`, `tree_top_k`, `tree_budget`, `lookup` (see
    `TreeSettings`; None: chosen from measured costs). With `return_dict_in_generate=True` the output has
    `speculation_stats`, one `EngineStats` per row. The drafter is attached for the call unless it is attached to
    `target` already (then it stays so); no hook is left behind.
    """
    reason = drafter.tree_unsupported_reason()
    if reason is not None:
        raise ValueError(f"{type(drafter).__name__} cannot draft trees: {reason}")
    if kwargs.get("assistant_model") is not None:
        raise ValueError("Pass the drafter as `drafter`, not `assistant_model`, to the speculative engine.")
    kwargs.pop("assistant_model", None)
    settings = TreeSettings(depth=tree_depth, top_k=tree_top_k, budget=tree_budget, lookup=lookup)
    # transformers hands a `custom_generate` callable no tokenizer, so stop strings become a stopping criterion here
    tokenizer, stop_strings = kwargs.pop("tokenizer", None), kwargs.pop("stop_strings", None)
    if stop_strings is not None:
        if tokenizer is None:
            raise ValueError("`stop_strings` needs the tokenizer: pass `tokenizer=` as with `generate`.")
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(StopStringCriteria(tokenizer, stop_strings))
        kwargs["stopping_criteria"] = criteria
    attachment = getattr(drafter, "_attachment", None)
    if attachment is not None and attachment.target is target:
        context = contextlib.nullcontext()
    else:
        context = drafter.attached(target, allow_other_target=allow_other_target)
    loop = functools.partial(
        _decode, engine_drafter=drafter, engine_settings=settings, engine_streamer=streamer, engine_costs=costs
    )
    with context:
        return target.generate(*args, custom_generate=loop, streamer=streamer, **kwargs)
