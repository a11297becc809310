"""The speculative engine's loop: draft a tree, verify it in one target forward, accept, repeat.

One decoding loop for an unmodified transformers target and a drafter of this library (`MoADrafterModel`,
`EagleDrafterModel`: the `TreeDrafter` protocol), run through `target.generate(..., custom_generate=<callable>)` so
transformers prepares what `generate` users pass (logits processors, stopping criteria, generation config) and this
loop does the rest, gpt-fast's `speculative_decode` for a batch of trees:

    per cycle:  shape = policy.plan()                                   (policy.py: from the measured costs)
                drafter catches up on the tokens verified last cycle    (one drafter call)
                tree = build_tree + add_chain(lookup) + cut_to_budget    (tree.py: one drafter call per depth)
                logits = target([root, tree], tree mask)                 (one target forward)
                accepted path, next token = greedy_accept_tree / accept_path   (accept.py)
                the root's and the accepted path's slots are kept         (`SlotCache.commit`, tree.py)
                policy.update(what the cycle measured)

With a shape that is 0 drafter steps deep (the policy's plain arm) a cycle is plain decoding.

The folder ships inside every published drafter repo as transformers' `custom_generate/` (see `generate.py`): its
files import only torch, transformers and each other.
"""

import contextlib
import functools
import logging
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .accept import accept_path, greedy_accept_tree
from .policy import Costs, ShapePolicy, TreeSettings, measure_costs, measure_step_costs
from .tree import (
    SlotCache,
    Tree,
    TreeDrafter,
    add_chain,
    ancestors,
    build_tree,
    compact_cache,
    cut_to_budget,
    empty_tree,
    tree_attention_mask,
)

__all__ = [
    "Costs",
    "EngineOutput",
    "EngineStats",
    "Tree",
    "TreeDrafter",
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

logger = logging.getLogger(__name__)

# transformers 5.24 renamed the cache argument `past_key_values` to `cache` (see `CACHE_NAME` in drafting.py; this
# folder stands alone as custom_generate code, so it reads the installed name itself).
_CACHE_NAME = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


# ---------------------------------------------------------------------------------------------------------------------
# Statistics, output
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class EngineStats:
    """What the engine did for one row. `accepted_lengths[i]`: tokens the row gained at target call i (its first
    token, from the prompt's forward, counts as a call of length 1; plain decoding = all ones)."""

    accepted_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)  # drafted nodes verified per cycle (0: a plain cycle)
    drafted_tokens: int = 0
    lookup_tokens: int = 0  # drafted nodes proposed by prompt lookup only
    draft_time_s: float = 0.0  # the batch's times while this row was in it
    verify_time_s: float = 0.0
    exit_counts: list[int] = field(default_factory=list)  # drafted nodes per drafter exit (prompt lookup's not in it)
    loop_time_s: float = 0.0  # the batch's cycle time that was no target or drafter forward (the loop's own)

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
    """`GenerateDecoderOnlyOutput` plus `speculation_stats`: one `EngineStats` per row, `costs`: the `Costs` the
    tree shapes were chosen from, and `policy`: what the shape policy chose and measured (`ShapePolicy.summary`)."""

    speculation_stats: list | None = None
    costs: "Costs | None" = None
    policy: dict | None = None


def _layer_windows(config) -> dict[str, int | None]:
    """{layer type: its window (None: full attention)} of a target config, as transformers' masks read it. (The
    drafter config's `target_layer_types` reads the same fields; this folder ships alone in `custom_generate/`, so it
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


def _simple_stops(stopping, eos: torch.Tensor):
    """(max_length, eos ids) when `stopping` holds only transformers' max-length and EOS criteria (checked with
    arithmetic on the new tokens), else None (every new token's prefix goes through the criteria)."""
    max_length, ids = None, [eos]
    for c in stopping:
        if isinstance(c, MaxLengthCriteria):
            max_length = c.max_length if max_length is None else min(max_length, c.max_length)
        elif isinstance(c, EosTokenCriteria):
            ids.append(c.eos_token_id.flatten().to(eos.device))
        else:
            return None
    return max_length, set(torch.cat(ids).tolist())


# ---------------------------------------------------------------------------------------------------------------------
# One generate call
# ---------------------------------------------------------------------------------------------------------------------
class _Run:
    """The state of one engine call over a (left-padded) batch. Rows that finish leave the batch.

    `slots`: the target's cache and what each of its slots holds (`SlotCache`). The row's newest token (`roots`) has
    no target state yet. `pending`: per row the verified tokens the drafter has not seen, as (token, position, slot
    of the previous token's state).
    """

    def __init__(self, target, drafter, input_ids, mask, gc, processors, stopping, settings, streamer):
        self.target, self.drafter, self.gc, self.settings, self.streamer = target, drafter, gc, settings, streamer
        self.processors, self.stopping = processors, stopping
        windows = _layer_windows(target.config)
        impl = getattr(target.config, "_attn_implementation", "sdpa")
        if impl not in ("sdpa", "eager"):
            raise ValueError(
                f"The speculative engine passes a 4-D tree mask, which the '{impl}' attention cannot take. Load the "
                "target with attn_implementation='sdpa' (or 'eager')."
            )
        self.needs_hidden = bool(drafter.needs_target_hidden)
        self.num_exits = int(drafter.num_exits)
        B, P = input_ids.shape
        device = input_ids.device
        additive = target.dtype if impl == "eager" else None  # eager attention takes additive masks
        self.slots = SlotCache(B, device, windows, self.needs_hidden, additive)
        self.rows = list(range(B))  # original row index of each active row
        self.seqs = [input_ids[b] for b in range(B)]  # padded prompt + new tokens, per active row
        self.lists = [[] for _ in range(B)]  # new tokens per active row, as Python ints
        self.prompt_len = P
        self.done: dict[int, torch.Tensor] = {}
        self.stats = [EngineStats() for _ in range(B)]
        eos = gc.eos_token_id
        self.eos = torch.tensor([eos] if isinstance(eos, int) else (eos or []), dtype=torch.long, device=device)
        self.simple_stops = _simple_stops(stopping, self.eos)
        self.greedy = not gc.do_sample and len(processors) == 0  # acceptance by argmax, vectorised
        self.draft_state = drafter.tree_start(B)
        self.pending = [[] for _ in range(B)]
        self.roots = torch.zeros(B, dtype=torch.long, device=device)
        self.root_pos = torch.zeros(B, dtype=torch.long, device=device)
        self.costs: Costs | None = None
        self.policy: ShapePolicy | None = None
        self.drafter_started = False  # the drafter has read the prompt (its first catch-up, when a shape first drafts)
        self.lookup = settings.lookup
        if self.lookup is None:
            self.lookup = drafter.lookup_settings is not None
        # prompt lookup: per row a `LookupIndex` of its text (without left padding), kept as the row grows
        self.look = drafter.lookup_settings if self.lookup else None
        self.indexes = [None if self.look is None else self.look.index() for _ in range(B)]
        for b, start in enumerate((P - mask.sum(-1)).tolist() if self.look is not None else []):
            self.indexes[b].extend(input_ids[b, start:].tolist())
        self.exit_totals = torch.zeros(B, self.num_exits, dtype=torch.long, device=device)
        self.debug = logger.isEnabledFor(logging.DEBUG)  # each cycle's shape and why, logged

    # ----- the target ---------------------------------------------------------------------------------------------
    def target_forward(self, ids, q_pos, q_visible, logits_to_keep: int = 0):
        """One target forward of new tokens ids [B, Q] at positions q_pos [B, Q] seeing q_visible [B, Q, Q] among
        themselves and every valid cached slot (None: causal, no slot cached yet: the model builds the mask);
        returns the model output (its cache grows by Q slots)."""
        return self.target(
            input_ids=ids,
            attention_mask=None if q_visible is None else self.slots.masks(q_pos, q_visible),
            position_ids=q_pos,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=self.needs_hidden,
            **{_CACHE_NAME: self.slots.cache},
        )

    def prefill(self, valid: torch.Tensor) -> None:
        """The prompt's forward and the first new token of every row (`valid` [B, P]: False on left padding)."""
        ids = torch.stack(self.seqs)  # [B, P]
        B, P = ids.shape
        pos = (valid.long().cumsum(-1) - 1).clamp_min(0)  # [B, P]
        # Without padding the prompt is causal: the model builds its own mask, whose SDPA kernel skips the masked half
        # (a 4-D mask made a long prompt's attention ~1.5x dearer on a CPU). With padding, the 4-D mask.
        visible = None
        if not bool(valid.all()):
            causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()
            eye = torch.eye(P, dtype=torch.bool, device=ids.device)
            visible = (causal & valid[:, None, :]) | eye  # [B, P, P]; padding sees itself (no empty softmax row)
        t0 = time.perf_counter()
        out = self.target_forward(ids, pos, visible, logits_to_keep=1)
        self.slots.prefill(valid, pos, out.hidden_states[-1] if self.needs_hidden else None)
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

    # ----- one cycle ------------------------------------------------------------------------------------------------
    def cycle(self) -> None:
        """Draft, verify, accept: the whole loop in one page."""
        if self.policy is None:  # the first cycle: the target's costs of this batch (measured once per process)
            self.start_policy()
        t0 = time.perf_counter()
        self.forward_s = 0.0  # seconds in the target's and the drafter's forwards this cycle
        remaining = self.gc.max_length - self.prompt_len - max(len(t) for t in self.lists)  # tokens still to come
        chains = None  # prompt lookup's continuation per row (None where it has none); None: no lookup this cycle
        if self.lookup and remaining > 1 and self.settings.budget != 0:
            chains = [self.lookup_chain(i, remaining - 1) for i in range(len(self.rows))]
        shape = self.policy.plan(remaining, self.policy.context_of(chains), len(self.rows))
        if self.debug:
            logger.debug("cycle: %d rows, depth %d, top-k %d: %s", len(self.rows), shape.depth, shape.top_k, shape.why)
        tree, chains, t0 = self.draft(shape, chains, t0)  # catch-up, tree and lookup chains, cut to the budget
        t1 = time.perf_counter()  # (on a CUDA device the drafter's queued kernels end in the verification's time: one
        # host synchronisation per cycle, the acceptance's)
        draft_s = t1 - t0 if shape.depth else 0.0
        start = self.slots.width  # the root's slot
        anc = ancestors(tree.parents, tree.depth)  # [B, N, N]
        out = self.verify(tree, anc)  # the target's forward over [root, tree]: logits [B, 1+N, V]
        lengths, new_tokens, keep = self.accept(tree, anc, out.logits)  # keep [B, 1+A]: the root, the accepted path
        verify_s = time.perf_counter() - t1
        self.slots.commit(keep, lengths, self.root_pos, out.hidden_states[-1] if self.needs_hidden else None)
        if tree.size:
            self.exit_totals += tree.exit_counts(self.num_exits)
        look = self.lookup_outcomes(chains, new_tokens) if chains is not None else []
        counts = self.tree_counts(tree)  # before rows leave in `emit`
        self.emit(new_tokens, self.root_pos + 1, slots_from=start)
        seconds = time.perf_counter() - t0
        self.policy.update(tree, [len(t) - 1 for t in new_tokens], look, seconds, draft_s, verify_s)
        self.add_stats(counts, draft_s, verify_s, max(0.0, seconds - self.forward_s))  # the rest: the loop's own

    def start_policy(self) -> None:
        if self.costs is None:
            self.costs = _costs_for(self)
        self.policy = ShapePolicy(self.settings, self.costs, len(self.rows), self.lookup, self.costs.learned)

    def draft(self, shape, chains: list | None, t0: float):
        """This cycle's tree (empty for a plain cycle), cut to the budget, the lookup chains in it (None: none) and
        when its drafting started (`t0`, or later after the drafter's one-off start). The drafter catches up on the
        tokens verified since its last call, unless prompt lookup drafts alone (where every row has a continuation,
        or the shape drafts no network): then the drafter waits."""
        if not shape.depth:
            return empty_tree(len(self.rows), self.roots.device), None, t0
        lookup_only = shape.lookup_first and chains is not None and (not shape.network or None not in chains)
        root_logits, draft_s0 = None, 0.0
        if not lookup_only:
            t_catch = time.perf_counter()
            root_logits = self.catch_up()  # [B, V]
            draft_s0 = time.perf_counter() - t_catch
            if not self.drafter_started:  # the prompt's catch-up (and the drafter's step costs): one-off, not an arm's
                self.drafter_started = True
                if not self.costs.step:
                    self.costs.step.update(measure_step_costs(self.drafter, self))
                t0, draft_s0, self.forward_s = time.perf_counter(), 0.0, 0.0
        t_tree = time.perf_counter()
        policy = self.policy
        if root_logits is None:
            tree = empty_tree(len(self.rows), self.roots.device)
        else:
            depth = min(shape.depth, getattr(self.drafter, "draft_depth_limit", None) or shape.depth)  # a block's
            tree = build_tree(
                _Timed(self), self.draft_state, root_logits, self.root_pos, depth, shape.top_k, shape.widths,
                policy.gamma,
            )  # fmt: skip
        if shape.lookup and chains is not None and any(c is not None for c in chains):
            tree = add_chain(tree, chains, [c and policy.lookup_log_probs(len(c)) for c in chains])
        if root_logits is not None:
            self.drafter.tree_end(self.draft_state)
        draft_s = draft_s0 + time.perf_counter() - t_tree
        limit = min(tree.size, self.settings.max_budget)
        seconds = None if shape.budget is not None else policy.cycle_seconds(limit, draft_s)
        return cut_to_budget(tree, shape.budget, self.settings.max_budget, seconds), chains, t0

    def tree_counts(self, tree: Tree) -> list:
        """(original row, drafted nodes, nodes by prompt lookup alone) per active row."""
        sizes = tree.real.sum(1).tolist() if tree.size else [0] * len(self.rows)
        lookups = tree.lookup.sum(1).tolist() if tree.size else [0] * len(self.rows)
        return list(zip(self.rows, sizes, lookups))

    def add_stats(self, counts: list, draft_s: float, verify_s: float, loop_s: float) -> None:
        for b, size, lookups in counts:
            s = self.stats[b]
            s.tree_sizes.append(size)
            s.drafted_tokens += size
            s.lookup_tokens += lookups
            s.draft_time_s += draft_s
            s.verify_time_s += verify_s
            s.loop_time_s += loop_s

    def lookup_chain(self, i: int, room: int):
        """Prompt lookup's continuation [n] for active row i (at most `room` tokens), or None."""
        if self.look is None:
            return None
        chain = self.look.propose(self.indexes[i], room, 0, self.eos)
        return None if chain is None else chain.tolist()

    @staticmethod
    def lookup_outcomes(chains, new_tokens) -> list:
        """Per row with a chain: (its tokens checked against the tokens emitted, the right prefix among them, the
        chain's length)."""
        out = []
        for chain, toks in zip(chains, new_tokens):
            if not chain:
                continue
            checked = min(len(chain), len(toks))
            right = 0
            while right < checked and chain[right] == toks[right]:
                right += 1
            out.append((min(checked, right + 1), right, len(chain)))  # after the first wrong one: not checked
        return out

    def verify(self, tree: Tree, anc: torch.Tensor):
        """One target forward over [root, tree]: the output (logits [B, 1+N, V])."""
        B, N = tree.tokens.shape
        ids = torch.cat([self.roots[:, None], tree.tokens], dim=1)  # [B, 1+N]
        q_pos = torch.cat([self.root_pos[:, None], self.root_pos[:, None] + tree.depth], dim=1)  # [B, 1+N]
        visible = torch.ones(B, 1 + N, 1 + N, dtype=torch.bool, device=ids.device)  # row 0 / column 0: the root
        visible[:, 0, 1:] = False
        visible[:, 1:, 1:] = anc
        t0 = time.perf_counter()
        out = self.target_forward(ids, q_pos, visible)
        self.forward_s += time.perf_counter() - t0
        return out

    def accept(self, tree: Tree, anc: torch.Tensor, logits: torch.Tensor):
        """lengths [B] (accepted drafts), new tokens per row (accepted drafts, then the target's token) and keep
        [B, 1+A]: the new cache slots to keep (the root's, then the path's)."""
        B, N = tree.tokens.shape
        device = logits.device
        if self.greedy:
            argmax = logits.float().argmax(-1)  # [B, 1+N] (in float32 as `generate`; a bf16 argmax is slower here)
            if N == 0:
                return (
                    torch.zeros(B, dtype=torch.long, device=device),
                    [[t] for t in argmax[:, 0].tolist()],
                    (torch.zeros(B, 1, dtype=torch.long, device=device)),
                )
            D = int(tree.depth.max())
            length, path, nxt = greedy_accept_tree(tree.tokens, tree.parents, tree.depth, tree.real, anc, argmax, D)
            words = tree.tokens.gather(1, path.clamp_min(0))  # [B, D]
            host = torch.cat([length[:, None], nxt[:, None], words], 1).tolist()  # the cycle's one host sync
            new_tokens = [row[2 : 2 + row[0]] + [row[1]] for row in host]
            A = max(row[0] for row in host)
        else:
            tokens, parents, real = tree.tokens.tolist(), tree.parents.tolist(), tree.real.tolist()
            paths, new_tokens = [], []
            for i in range(B):

                def scores_at(node, path, i=i):
                    drafts = torch.tensor([tokens[i][c] for c in path], dtype=torch.long, device=device)
                    return self.process(i, torch.cat([self.seqs[i], drafts]), logits[i, node + 1])

                p, nxt_token = accept_path(tokens[i], parents[i], real[i], scores_at, self.gc.do_sample)
                paths.append(p)
                new_tokens.append([tokens[i][c] for c in p] + [nxt_token])
            A = max(len(p) for p in paths)
            path = torch.tensor([p + [-1] * (A - len(p)) for p in paths], dtype=torch.long, device=device)
            length = torch.tensor([len(p) for p in paths], device=device)
        keep = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device), path[:, :A] + 1], 1)  # [B, 1+A]
        return length, new_tokens, keep.clamp_min(0)

    def process(self, i: int, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The logits processors on active row i: scores [V] after its sequence ids [L]. The processors were built
        for the whole batch (some keep per-row state, e.g. the repetition penalty's padding lengths), so they see
        a batch of the original size in which every row is row i, and row i's result is kept."""
        b, B = self.rows[i], len(self.stats)
        scores = self.processors(ids[None].expand(B, -1), logits.float()[None].repeat(B, 1))  # [B, V]
        return scores[b]

    # ----- bookkeeping after each target call -----------------------------------------------------------------------
    def stop_at(self, i: int, toks: list) -> int | None:
        """The number of `toks` kept when one of them ends active row i (stopping criteria), else None."""
        if self.simple_stops is not None:
            max_length, eos = self.simple_stops
            n = len(self.seqs[i])
            for j, t in enumerate(toks):
                if t in eos or (max_length is not None and n + j + 1 >= max_length):
                    return j + 1
            return None
        seq = self.seqs[i]
        for j in range(len(toks)):  # the first token that satisfies a stopping criterion ends the row
            cand = torch.cat([seq, torch.tensor(toks[: j + 1], dtype=seq.dtype, device=seq.device)])
            if bool(self.stopping(cand[None], None)[0]):
                return j + 1
        return None

    def emit(self, new_tokens: list, first_pos: torch.Tensor, slots_from: int) -> None:
        """Append each row's new tokens (accepted drafts, then the target's token) at positions first_pos [B] on,
        stop rows that are done, queue the tokens for the drafter (`slots_from`: the cache slot of the state of the
        first new token's predecessor; the following ones sit in the slots after it)."""
        finished = []
        first = first_pos.tolist()
        for i, toks in enumerate(new_tokens):
            b = self.rows[i]
            stop = self.stop_at(i, toks)
            if stop is not None:
                toks = toks[:stop]
                finished.append(i)
            seq = self.seqs[i]
            self.seqs[i] = torch.cat([seq, torch.tensor(toks, dtype=seq.dtype, device=seq.device)])
            self.lists[i] += toks
            if self.indexes[i] is not None:
                self.indexes[i].extend(toks)
            self.stats[b].accepted_lengths.append(len(toks))
            self.pending[i] += [(t, first[i] + j, slots_from + j) for j, t in enumerate(toks)]
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
            self.add_exits(i)
        keep = [i for i in range(len(self.rows)) if i not in set(rows)]
        if not keep:
            self.rows = []
            return
        index = torch.tensor(keep, device=self.roots.device)
        self.slots.select_rows(index)
        self.roots, self.root_pos = self.roots[index], self.root_pos[index]
        self.exit_totals = self.exit_totals[index]
        self.drafter.tree_select_rows(self.draft_state, index)
        self.rows = [self.rows[i] for i in keep]
        for name in ("seqs", "lists", "pending", "indexes"):
            setattr(self, name, [getattr(self, name)[i] for i in keep])

    def add_exits(self, i: int) -> None:
        self.stats[self.rows[i]].exit_counts = self.exit_totals[i].tolist()

    def catch_up(self) -> torch.Tensor:
        """The drafter reads every verified token it has not seen; logits [B, V] after each row's root."""
        n = max(len(p) for p in self.pending)
        B, device = len(self.pending), self.roots.device
        table = torch.zeros(4, B, n, dtype=torch.long)  # token, position, previous slot, valid
        table[2] = -1
        for b, items in enumerate(self.pending):
            if items:
                t, p, s = zip(*items)
                table[:3, b, n - len(items) :] = torch.tensor([t, p, s])
                table[3, b, n - len(items) :] = 1
        tokens, positions, prev, valid = table.to(device).unbind(0)
        valid = valid.bool()
        hidden = self.slots.hidden_at(prev) if self.needs_hidden else None  # [B, n, d]
        self.pending = [[] for _ in range(B)]
        t0 = time.perf_counter()
        logits = self.drafter.tree_catch_up(self.draft_state, tokens, positions, valid, prev, self.slots.cache, hidden)
        self.forward_s += time.perf_counter() - t0
        return logits

    def output(self):
        for i, b in enumerate(self.rows):
            self.done[b] = self.seqs[i]
            self.add_exits(i)
        seqs = [self.done[b] for b in range(len(self.stats))]
        length = max(s.shape[0] for s in seqs)
        gc = self.gc
        pad = gc.pad_token_id if gc.pad_token_id is not None else _first(gc.eos_token_id, 0)
        out = torch.full((len(seqs), length), pad, dtype=seqs[0].dtype, device=seqs[0].device)
        for b, s in enumerate(seqs):
            out[b, : s.shape[0]] = s
        if self.streamer is not None:
            self.streamer.end()
        summary = None
        if self.policy is not None:
            summary = self.policy.summary()
            self.costs.learned = self.policy.learned()  # the next call with these costs starts from it
        if summary is not None and logger.isEnabledFor(logging.DEBUG):
            logger.debug("speculative engine call, batch %d: %s", len(self.stats), summary)
        if not self.gc.return_dict_in_generate:
            return out
        return EngineOutput(sequences=out, speculation_stats=self.stats, costs=self.costs, policy=summary)


class _Timed:
    """The run's drafter as `build_tree` calls it, adding the time of each `tree_step` to the run's forward time."""

    def __init__(self, run: _Run):
        self.run = run

    def tree_step(self, *args):
        t0 = time.perf_counter()
        logits = self.run.drafter.tree_step(*args)
        self.run.forward_s += time.perf_counter() - t0
        return logits


def _first(value, default):
    if isinstance(value, (list, tuple)):
        return value[0] if value else default
    return default if value is None else value


# Measured once per (target, drafter, device, dtype, batch size) and process: measuring takes about a second, and
# the same costs serve every later call (pass `costs=` to reuse or override them).
_COSTS: dict[tuple, Costs] = {}


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
        _COSTS[key] = measure_costs(target, drafter, run, steps=False)  # the drafter's once it has caught up
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
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()  # [B, P]
    run = _Run(
        model,
        engine_drafter,
        input_ids,
        mask,
        gc,
        logits_processor,
        stopping_criteria,
        engine_settings,
        engine_streamer,
    )
    run.costs = engine_costs
    run.prefill(mask)
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
    if not isinstance(drafter, TreeDrafter):
        missing = [n for n in ("tree_start", "tree_catch_up", "tree_step", "tree_end") if not hasattr(drafter, n)]
        raise ValueError(
            f"{type(drafter).__name__} is not a tree drafter (missing {', '.join(missing) or 'part of TreeDrafter'}): "
            "pass a MoA or EAGLE drafter of this library, or use `target.generate(assistant_model=...)`."
        )
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
    if drafter.attached_target is target:
        context = contextlib.nullcontext()
    else:
        context = drafter.attached(target, allow_other_target=allow_other_target)
    loop = functools.partial(
        _decode, engine_drafter=drafter, engine_settings=settings, engine_streamer=streamer, engine_costs=costs
    )
    with context:
        return target.generate(*args, custom_generate=loop, streamer=streamer, **kwargs)
