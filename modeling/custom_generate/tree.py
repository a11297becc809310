"""The draft tree: what is drafted, how it is cut to a budget, and what each verified token sees.

A tree holds per row N drafted nodes, parents before children; the root (parent -1) is the row's last verified token,
which the target verifies with the tree in one forward over [root, node 1, ..., node N]:

    build_tree      EAGLE-2's dynamic tree: per depth the drafter runs once over the frontier (the most probable
                    nodes of the newest depth by path probability), each frontier node proposes its top-k children
    add_chain       a chain of tokens (prompt lookup's continuation) joins the tree under the root
    cut_to_budget   the n most probable nodes (a prefix of that order is a tree), n fixed or the n that maximises
                    expected tokens per second of the cycle
    ancestors       A[b, i, j] = node j is node i or one of its ancestors (the tree's attention among its nodes, and
                    the greedy acceptance rule: node i is accepted iff every j with A[i, j] matches)
    tree_attention_mask / compact_cache   the target side: a 4-D mask over the cache and the tree, and moving the
                    accepted path's keys/values into place
    SlotCache       the target's cache with what each slot holds: prefill, the masks of a forward, commit of the
                    verified slots, row selection

`TreeDrafter` declares what the engine needs of a drafter. This file ships inside every published drafter repo
(custom_generate/), so it imports only torch, transformers and its sibling policy_core.py.
"""

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from transformers import DynamicCache

from .policy_core import best_index

__all__ = [
    "SlotCache",
    "Tree",
    "TreeDrafter",
    "add_chain",
    "ancestors",
    "build_tree",
    "compact_cache",
    "cut_to_budget",
    "empty_tree",
    "tree_attention_mask",
]

NEG = -float("inf")


@runtime_checkable
class TreeDrafter(Protocol):
    """What the engine calls on a drafter (`MoADrafterModel` and `EagleDrafterModel` implement it).

    `tree_start(B)` a fresh per-call state; `tree_catch_up(state, tokens, positions, valid, prev_slots, target_cache,
    prev_hidden)` feeds the newly verified tokens [B, n] and returns float logits [B, V] after each row's root;
    `tree_step(state, tokens, positions, parents)` feeds one depth of nodes [B, w] (parents: their number among the
    nodes fed this cycle, -1 = the root) and returns logits [B, w, V]; `tree_end(state)` forgets the cycle's nodes;
    `tree_select_rows(state, rows)` keeps rows; `lookup_proposal(ids [1, T], max_new, min_new, eos)` prompt lookup's
    continuation [n] or None; `lookup_settings` None when lookup is off, else (as `LookupSettings`) `index()` an empty
    index of a row's text (`extend(tokens)` as it grows) and `propose(index, max_new, min_new, eos)` that continuation
    (the engine looks up every row every cycle: an index does not rescan the text); `needs_target_hidden`:
    tree_catch_up reads the target's final hidden states; `num_exits` the drafter's exits (1 but for sorted drafters,
    whose state then carries `root_exits` [B] and `node_exits` [B, w]); `tree_unsupported_reason()` None or why it
    cannot draft trees; `attached(target, allow_other_target)` a context manager attaching it to the target;
    `attached_target` the target it is attached to (None: detached; the engine attaches it for the call unless it is
    attached to the call's target).
    """

    needs_target_hidden: bool
    num_exits: int
    lookup_settings: object
    attached_target: object

    def tree_unsupported_reason(self) -> str | None: ...

    def tree_start(self, batch_size: int): ...

    def tree_catch_up(self, state, tokens, positions, valid, prev_slots, target_cache, prev_hidden=None): ...

    def tree_step(self, state, tokens, positions, parents): ...

    def tree_end(self, state) -> None: ...

    def tree_select_rows(self, state, rows: torch.Tensor) -> None: ...

    def lookup_proposal(self, input_ids, max_new_tokens: int, min_new_tokens: int, eos): ...

    def attached(self, target, allow_other_target: bool = False): ...


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

    def exit_counts(self, num_exits: int) -> torch.Tensor:
        """[B, num_exits]: per row, the real nodes the drafter's network proposed at each exit."""
        exit = torch.ones_like(self.tokens) if self.exit is None else self.exit
        network = self.real & ~self.lookup  # [B, N]
        counts = torch.nn.functional.one_hot(exit.clamp(0, num_exits), num_exits + 1)[..., 1:]  # [B, N, K]
        return (counts * network[..., None]).sum(1)


def empty_tree(B: int, device) -> Tree:
    z = torch.zeros(B, 0, dtype=torch.long, device=device)
    return Tree(tokens=z, parents=z, depth=z, score=z.float(), real=z.bool(), lookup=z.bool())


def ancestors(parents: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """bool [B, N, N]: node j is node i itself or one of its ancestors (parents [B, N], -1 = the root).

    A node's ancestor at depth e is its (d - e)-th parent: climbing the parents max(depth) times marks them all
    (one gather per depth; a chain of N nodes is N cheap steps, a tree of depth D is D)."""
    B, N = parents.shape
    anc = torch.zeros(B, N, N + 1, dtype=torch.bool, device=parents.device)  # column N: the root
    node = torch.arange(N, device=parents.device).expand(B, N)  # [B, N] the node being climbed from
    parent_of = torch.cat([parents.clamp_min(-1), parents.new_full((B, 1), -1)], dim=1)  # [B, N+1]; root's: -1
    parent_of = torch.where(parent_of < 0, N, parent_of)  # the root at index N
    for _ in range(int(depth.max()) if N else 0):
        anc.scatter_(2, node[..., None], True)
        node = parent_of.gather(1, node)  # [B, N] one level up (the root stays the root)
    return anc[..., :N]


def build_tree(drafter, state, root_logits, root_pos, depth: int, top_k: int, widths=None, gamma: float = 1.0):
    """EAGLE-2's dynamic tree, `depth` drafter steps deep. Per depth the drafter runs once over the frontier (the `w`
    most probable nodes of the newest depth by path probability, w = widths[d] or top_k); each frontier node proposes
    its top_k children; every proposal is a candidate. Returns every candidate as a `Tree` (parents first;
    `cut_to_budget` picks the ones to verify). `gamma` calibrates the drafter's probabilities to what the target
    accepts: a node's score is gamma x its path log-probability. `widths` may also be a function
    (depth d, newest scores [B, c]) -> w, 0 to stop drafting (the shape policy's per-depth decision)."""
    B, device = root_logits.shape[0], root_logits.device
    k = top_k
    score, tokens = root_logits.float().log_softmax(-1).topk(k, dim=-1)  # [B, k] children of the root
    score = gamma * score
    tok, par, dep, sco = [tokens], [torch.full_like(tokens, -1)], [torch.ones_like(tokens)], [score]
    root_exits = getattr(state, "root_exits", None)  # a sorted drafter's exit per evaluation; else all exit 1
    ext = [torch.ones_like(tokens) if root_exits is None else root_exits[:, None].expand(B, k)]
    fed = [torch.full_like(tokens, -1)]  # per candidate: its number among the nodes fed to the drafter
    first, fed_count = 0, 0  # index of the newest depth's first candidate; nodes fed so far
    for d in range(1, depth):
        newest = sco[-1]  # [B, c]
        w = widths(d, newest) if callable(widths) else (widths[d] if widths is not None else k)
        if w <= 0:
            break
        front_score, front = newest.topk(min(w, newest.shape[1]), dim=-1)  # [B, w]
        w = front.shape[1]
        parent = par[-1].gather(1, front)  # [B, w] candidate index of each frontier node's parent, or -1
        all_fed = torch.cat(fed, 1)  # [B, count]
        parent_number = torch.where(parent < 0, parent, all_fed.gather(1, parent.clamp_min(0)))  # [B, w]
        front_tokens = tok[-1].gather(1, front)  # [B, w]
        logits = drafter.tree_step(state, front_tokens, root_pos[:, None].expand(B, w) + d, parent_number)  # [B,w,V]
        fed[-1] = fed[-1].scatter(1, front, torch.arange(fed_count, fed_count + w, device=device).expand(B, w))
        fed_count += w
        child_score, child_tokens = logits.float().log_softmax(-1).topk(k, dim=-1)  # [B, w, k]
        tok.append(child_tokens.reshape(B, w * k))  # [B, w*k]
        par.append((front + first)[..., None].expand(B, w, k).reshape(B, w * k))  # parents: the frontier's indices
        first += newest.shape[1]
        dep.append(torch.full((B, w * k), d + 1, dtype=torch.long, device=device))
        sco.append((gamma * child_score + front_score[..., None]).reshape(B, w * k))
        node_exits = getattr(state, "node_exits", None)  # [B, w]
        exits = torch.ones_like(front) if node_exits is None else node_exits
        ext.append(exits[..., None].expand(B, w, k).reshape(B, w * k))
        fed.append(torch.full((B, w * k), -1, dtype=torch.long, device=device))
    tokens = torch.cat(tok, 1)
    real = torch.ones_like(tokens, dtype=torch.bool)
    return Tree(tokens, torch.cat(par, 1), torch.cat(dep, 1), torch.cat(sco, 1), real, ~real, torch.cat(ext, 1))


def add_chain(tree: Tree, chains: list, log_probs) -> Tree:
    """Add one chain of tokens per row under the root (prompt lookup's continuation; None: none for that row).
    Where a prefix of it is already in the tree it follows those nodes (raising their score to the chain's), the rest
    becomes new nodes after the existing ones. Chain token j (1-based) scores log_probs[j-1] (a float: j x it; a
    list per row: that row's), the estimated log probability that the chain's first j tokens are all right. Rows are
    padded to one size with fillers (children of the root that are never accepted, real False, and never chosen,
    score -inf)."""
    B, N = tree.tokens.shape
    device = tree.tokens.device
    chains = [None if c is None else (c.tolist() if torch.is_tensor(c) else list(c)) for c in chains]
    longest = max((len(c) for c in chains if c), default=0)
    if not longest:
        return tree
    if isinstance(log_probs, float):
        log_probs = [j * log_probs for j in range(1, longest + 1)]
    if not log_probs or not isinstance(log_probs[0], (list, type(None))):
        log_probs = [log_probs] * B  # one list for every row
    # follow the chain through existing nodes: only nodes whose parent is followed can match, so one pass in
    # parents-first order per chain token suffices; the tree is small, so this reads it once as lists
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    follow, new = [], []  # per row: existing node per chain token (or -1); the chain tokens that become new nodes
    for b in range(B):
        chain, nodes, node = chains[b] or [], [], -1
        for t in chain:
            nxt = next((i for i in range(N) if parents[b][i] == node and tokens[b][i] == t), -1) if node >= -1 else -1
            nodes.append(nxt)
            node = nxt if nxt >= 0 else -2  # -2: left the tree; the rest is new
        follow.append(nodes)
        new.append(sum(1 for i in nodes if i < 0))
    M = max(new)
    ext_tok = torch.zeros(B, M, dtype=torch.long)
    ext_par = torch.full((B, M), -1, dtype=torch.long)
    ext_dep = torch.ones(B, M, dtype=torch.long)
    ext_sco = torch.full((B, M), NEG)
    ext_real = torch.zeros(B, M, dtype=torch.bool)
    raise_idx, raise_val = [], []
    for b in range(B):
        prev, m = -1, 0
        for j, (t, i) in enumerate(zip(chains[b] or [], follow[b])):
            if i >= 0:
                raise_idx.append((b, i))
                raise_val.append(log_probs[b][j])
                prev = i
            else:
                ext_tok[b, m], ext_par[b, m], ext_dep[b, m] = t, prev, j + 1
                ext_sco[b, m], ext_real[b, m] = log_probs[b][j], True
                prev = N + m
                m += 1
    score = tree.score.clone()
    if raise_idx:
        rows, cols = zip(*raise_idx)
        rows, cols = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
        score[rows, cols] = torch.maximum(score[rows, cols], torch.tensor(raise_val, device=device))
    exit = torch.ones_like(tree.tokens) if tree.exit is None else tree.exit
    return Tree(
        tokens=torch.cat([tree.tokens, ext_tok.to(device)], 1),
        parents=torch.cat([tree.parents, ext_par.to(device)], 1),
        depth=torch.cat([tree.depth, ext_dep.to(device)], 1),
        score=torch.cat([score, ext_sco.to(device)], 1),
        real=torch.cat([tree.real, ext_real.to(device)], 1),
        lookup=torch.cat([tree.lookup, ext_real.to(device)], 1),
        exit=torch.cat([exit, torch.zeros(B, M, dtype=torch.long, device=device)], 1),
    )


def cut_to_budget(tree: Tree, budget: int | None, max_budget: int = 64, seconds=None) -> Tree:
    """The nodes to verify: the n most probable (by path probability; a prefix of that order is a tree, as a child
    is never likelier than its parent and ties keep parents first). n = `budget`, or with budget None the n that
    maximises the cycle's expected tokens per second (the policy core's `best_index`), sum over rows of (1 + sum of the
    kept path probabilities) / seconds[n] (`seconds` [max_budget+1]: the cycle's time with n nodes verified,
    n = 0..max_budget)."""
    score, order = tree.score.sort(dim=-1, descending=True, stable=True)  # [B, N]
    B, N = score.shape
    if budget is not None:
        n = min(budget, N)
    else:
        limit = min(N, max_budget)
        gain = torch.cat([score.new_zeros(1), score[:, :limit].exp().sum(0).cumsum(0)])  # [limit+1]: n = 0..limit
        gain = gain.to(seconds.device)  # the cost table is the host's (a CUDA tree's scores come over)
        n = best_index(gain + B, seconds[: limit + 1])  # B: each row's own (bonus or correction) token
    if n == N:
        return tree
    keep = order[:, :n].sort(dim=-1).values  # [B, n] parents first again
    return tree.select(keep)


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
    drop the rest (keep [B, K] indices into the slots added since `start`; padding entries repeat index 0). Where
    every row keeps its first K slots in order (a chain's accepted prefix), nothing moves: the cache is cropped."""
    K = keep.shape[1]
    in_place = bool((keep == torch.arange(K, device=keep.device)).all())
    if in_place and cache.layers[0].keys.shape[2] == start + K:  # every new slot kept (a plain cycle): nothing to do
        return
    idx = None
    for layer in cache.layers:
        for name in ("keys", "values"):
            states = getattr(layer, name)  # [B, H, S, D]
            if not in_place:
                B, H, _, D = states.shape
                if idx is None or idx.shape != (B, H, K, D):  # built once for layers of one shape
                    idx = (start + keep)[:, None, :, None].expand(B, H, K, D)  # [B, H, K, D]
                states[:, :, start : start + K] = states.gather(2, idx)
            setattr(layer, name, states[:, :, : start + K])


class SlotCache:
    """The target's cache as the engine keeps it (gpt-fast's `KVCache`, for a batch of trees): a `DynamicCache` of
    full layers whose slot s of row b holds a verified token at position `pos[b, s]` where `valid[b, s]` (left padding
    and rows that accepted fewer tokens than others leave invalid slots; sliding windows are applied by the masks,
    `windows` {layer type: its window, None: full}), and with `keep_hidden` the target's final hidden state of each
    slot (`hidden` [B, S, d], for drafters that read it). `additive`: a dtype for eager attention's additive masks.

    A forward appends its Q tokens' keys/values after the S slots, seeing them through `masks`; then `prefill` (the
    prompt's forward: every token kept) or `commit` (a verification: the root and its accepted path kept) records the
    new slots, or `rollback` drops them.
    """

    def __init__(self, batch_size: int, device, windows: dict, keep_hidden: bool, additive=None):
        self.cache = DynamicCache()
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # [B, S]
        self.pos = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # [B, S]
        self.hidden: torch.Tensor | None = None  # [B, S, d]
        self.windows, self.keep_hidden, self.additive = windows, keep_hidden, additive

    @property
    def width(self) -> int:
        """S: the slots recorded (the cache holds as many, plus those of a forward not recorded yet)."""
        return self.valid.shape[1]

    def masks(self, q_pos: torch.Tensor, q_visible: torch.Tensor):
        """The attention mask of Q new tokens at positions q_pos [B, Q] that see q_visible [B, Q, Q] among themselves
        and every valid slot: [B, 1, Q, S+Q] (bool, or additive), or {layer type: its mask} for several types."""
        masks = {}
        for kind, window in self.windows.items():
            m = tree_attention_mask(self.valid, self.pos, q_pos, q_visible, window)  # [B, 1, Q, S+Q]
            if self.additive is not None:
                dtype = self.additive
                m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
            masks[kind] = m
        return masks if len(masks) > 1 else next(iter(masks.values()))

    def prefill(self, valid: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        """Record the prompt's slots after its forward: every token [B, P] kept, valid where `valid`, at `pos`;
        hidden [B, P, d] their final hidden states."""
        self._append(valid, pos, hidden)

    def commit(self, keep: torch.Tensor, lengths: torch.Tensor, root_pos: torch.Tensor, hidden=None) -> None:
        """Record a verification's slots after its forward over [root, tree]: row b keeps the tokens keep[b] [1+A]
        (indices among the forward's tokens: the root, then its accepted path; padding repeats 0), moved next to
        the slots, valid for the root and its lengths[b] accepted drafts, at positions root_pos[b] + j; hidden
        [B, 1+N, d] the forward's final hidden states."""
        compact_cache(self.cache, self.width, keep)
        j = torch.arange(keep.shape[1], device=keep.device)  # [1+A]
        if hidden is not None:
            hidden = hidden.gather(1, keep[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, 1+A, d]
        self._append(j[None, :] <= lengths[:, None], root_pos[:, None] + j[None, :], hidden)

    def _append(self, valid: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self.valid = torch.cat([self.valid, valid], dim=1)  # [B, S+K]
        self.pos = torch.cat([self.pos, pos], dim=1)  # [B, S+K]
        if self.keep_hidden:
            self.hidden = hidden if self.hidden is None else torch.cat([self.hidden, hidden], dim=1)  # [B, S+K, d]

    def rollback(self) -> None:
        """Drop the keys/values of a forward that was not recorded (e.g. dummy tokens timed)."""
        extra = self.cache.get_seq_length() - self.width
        if extra > 0:
            self.cache.crop(-extra)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows `index` (LongTensor [B']), in this order."""
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.valid, self.pos = self.valid[index], self.pos[index]
        if self.hidden is not None:
            self.hidden = self.hidden[index]

    def hidden_at(self, slots: torch.Tensor) -> torch.Tensor:
        """The final hidden states [B, n, d] of the slots `slots` [B, n] (zeros where -1: none)."""
        d = self.hidden.shape[-1]
        hidden = self.hidden.gather(1, slots.clamp_min(0)[..., None].expand(-1, -1, d))  # [B, n, d]
        return hidden * (slots >= 0)[..., None].to(hidden.dtype)
