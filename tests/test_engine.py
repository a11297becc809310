"""The speculative engine (modeling/custom_generate/engine.py): trees, batches and exactness.

The engine is checked with a test drafter that implements the drafter tree API by running a model on whole sequences
(no cache): its proposals are the model's (optionally perturbed) top tokens, so acceptance varies while the engine's
own cache handling, masks and acceptance are what is tested. The real drafters are tested through the engine in
tests/test_engine_drafters.py.
"""

import contextlib
import math

import pytest
import torch

from moa_hf.modeling.custom_generate import engine
from moa_hf.modeling.custom_generate.accept import accept_path, greedy_accept_tree
from moa_hf.modeling.custom_generate.engine import (
    Costs,
    Tree,
    TreeSettings,
    add_chain,
    compact_cache,
    cut_to_budget,
    speculative_generate,
    tree_attention_mask,
)
from moa_hf.modeling.custom_generate.tree import SlotCache, ancestors

from factory import make_target
from policy_sim import World, drive_engine

FLAT_COSTS = Costs(verify={1: 1.0, 64: 1.0}, step={1: 0.01, 8: 0.01})  # verifying is free: big trees


class FixedLookup:
    """Prompt lookup settings (`lookup_settings`) that propose what follows the text's length in a reference
    sequence: the index is the row's text as a list."""

    def __init__(self, reference: list):
        self.reference = reference

    def index(self) -> list:
        return []

    def propose(self, index: list, max_new_tokens, min_new_tokens, eos):
        n = len(index)
        return torch.tensor(self.reference[n : n + max_new_tokens]) if self.reference[n:] else None


class ModelTreeDrafter:
    """The drafter tree API over `model` run on whole sequences: logits = model's + noise (fixed per sequence)."""

    needs_target_hidden = False
    num_exits = 1
    attached_target = None

    def __init__(self, model, noise: float = 0.0, lookup: list | None = None):
        self.model, self.noise, self.config, self.dtype = model, noise, model.config, model.dtype
        self.lookup = lookup  # a reference sequence: lookup proposes what follows the current length (None: none)
        self.lookup_settings = FixedLookup(lookup) if lookup is not None else None
        self.memo = {}  # sequence -> logits (rows of a batch often repeat)

    def tree_unsupported_reason(self):
        return None

    @contextlib.contextmanager
    def attached(self, target, allow_other_target=False):
        yield self

    def lookup_proposal(self, input_ids, max_new_tokens, min_new_tokens, eos):
        return (
            None
            if self.lookup is None
            else self.lookup_settings.propose(input_ids[0].tolist(), max_new_tokens, 0, eos)
        )

    def tree_start(self, batch_size):
        return {"seqs": [[] for _ in range(batch_size)], "nodes": [[] for _ in range(batch_size)]}

    def _logits(self, seqs):
        out = []
        for seq in seqs:
            if tuple(seq) in self.memo:
                out.append(self.memo[tuple(seq)])
                continue
            logits = self.model(torch.tensor([seq])).logits[0, -1].float()  # [V]
            if self.noise:
                g = torch.Generator().manual_seed(hash(tuple(seq)) % 2**31)
                logits = logits + self.noise * torch.randn(logits.shape, generator=g)
            self.memo[tuple(seq)] = logits
            out.append(logits)
        return torch.stack(out)

    def tree_catch_up(self, state, tokens, positions, valid, prev_slots, target_cache, prev_hidden=None):
        for b in range(tokens.shape[0]):
            state["seqs"][b] += tokens[b][valid[b]].tolist()
            state["nodes"][b] = []
        return self._logits(state["seqs"])  # [B, V]

    def tree_step(self, state, tokens, positions, parents):
        out = []
        for b in range(tokens.shape[0]):
            seqs = []
            for j in range(tokens.shape[1]):
                p = int(parents[b, j])
                path = (state["nodes"][b][p] if p >= 0 else []) + [int(tokens[b, j])]
                state["nodes"][b].append(path)
                seqs.append(state["seqs"][b] + path)
            out.append(self._logits(seqs))
        return torch.stack(out)  # [B, k, V]

    def tree_end(self, state):
        state["nodes"] = [[] for _ in state["nodes"]]

    def tree_select_rows(self, state, rows):
        for key in state:
            state[key] = [state[key][i] for i in rows.tolist()]


def _peaked(family="llama", scale=8.0, **overrides):
    """A tiny target whose next-token distributions are peaked (a random one's are nearly uniform)."""
    target = make_target(family, **overrides)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(scale)
    return target


SHAPES = [
    {},  # automatic
    {"tree_top_k": 1, "lookup": False},  # a chain
    {"tree_depth": 4, "tree_top_k": 3, "tree_budget": 12},
    {"tree_depth": 2, "tree_top_k": 8, "tree_budget": 64},
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("noise", [0.0, 2.0])
def test_greedy_batch1_equals_generate(noise, shape):
    target = _peaked()
    drafter = ModelTreeDrafter(target, noise)
    torch.manual_seed(0)
    for length, new in ((1, 7), (12, 30)):
        ids = torch.randint(3, 128, (1, length))
        ref = target.generate(ids, max_new_tokens=new, do_sample=False)
        out = speculative_generate(
            target, drafter, ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True,
            costs=FLAT_COSTS, **shape,
        )  # fmt: skip
        assert torch.equal(out.sequences, ref)
        stats = out.speculation_stats[0]
        assert stats.generated_tokens == new
        if noise == 0.0 and "tree_depth" in shape and new > 7:
            assert stats.mean_accepted_length > 1.5  # an oracle's drafts get accepted (where the shape is not
            # fixed the policy may decode plainly: on a tiny target a plain cycle is faster than any speculative one)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3", "mistral-sliding",
                                    "qwen2-sliding", "gemma3-sliding", "phi3-sliding"])  # fmt: skip
def test_greedy_families_batch1_and_batch3(family):
    """Token-identical to `target.generate` at batch 1, and each row of a left-padded batch of 3 to its own batch-1
    run (prompts longer than the sliding windows of the *-sliding targets)."""
    target = _peaked(family)
    drafter = ModelTreeDrafter(target, noise=1.0)
    torch.manual_seed(1)
    prompts = [torch.randint(3, 128, (n,)) for n in (5, 17, 11)]
    refs = [target.generate(p[None], max_new_tokens=20, do_sample=False)[0, p.shape[0] :] for p in prompts]
    shape = dict(costs=FLAT_COSTS, tree_depth=3, tree_top_k=2, tree_budget=6)  # fixed: it drafts (no plain arm)
    out = speculative_generate(
        target, drafter, prompts[1][None], max_new_tokens=20, do_sample=False, return_dict_in_generate=True, **shape
    )
    assert torch.equal(out.sequences[0, prompts[1].shape[0] :], refs[1])
    assert sum(out.speculation_stats[0].tree_sizes) > 0  # drafted trees were verified (not plain decoding)
    ids, mask = _left_pad(prompts)
    out = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=20, do_sample=False, **shape)
    for b, ref in enumerate(refs):
        assert out[b, ids.shape[1] :].tolist() == ref.tolist(), f"row {b}"


def _left_pad(prompts, pad=0):
    n = max(p.shape[0] for p in prompts)
    ids = torch.full((len(prompts), n), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), n, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, n - p.shape[0] :] = p
        mask[b, n - p.shape[0] :] = 1
    return ids, mask


def test_processors_and_stopping_like_generate():
    """Logits processors that read the sequence (repetition penalty, min_new_tokens) and EOS in the middle of an
    accepted path give generate's tokens; finished rows are padded with the pad token."""
    target = _peaked()
    drafter = ModelTreeDrafter(target, noise=0.0)
    torch.manual_seed(3)
    prompts = [torch.randint(3, 128, (n,)) for n in (6, 9)]
    ref = [target.generate(p[None], max_new_tokens=24, do_sample=False)[0, p.shape[0] :] for p in prompts]
    eos = int(ref[0][5])  # a token greedy decoding emits mid-way
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=0, repetition_penalty=1.3)
    for extra in ({}, {"min_new_tokens": 8}):
        ids, mask = _left_pad(prompts)
        out = speculative_generate(
            target, drafter, ids, attention_mask=mask, costs=FLAT_COSTS, tree_top_k=2, **kwargs, **extra
        )
        for b, p in enumerate(prompts):
            alone = target.generate(p[None], **kwargs, **extra)[0, p.shape[0] :]
            got = out[b, ids.shape[1] :]
            assert got[: alone.shape[0]].tolist() == alone.tolist()
            assert (got[alone.shape[0] :] == 0).all()  # padded after the row's end


def test_streamer_and_return_dict():
    target = _peaked()
    drafter = ModelTreeDrafter(target, noise=0.0)
    ids = torch.tensor([[5, 6, 7, 8]])
    seen = []

    class Collect:
        def put(self, value):
            seen.append(value.flatten().tolist())

        def end(self):
            seen.append("end")

    out = speculative_generate(
        target, drafter, ids, max_new_tokens=12, do_sample=False, streamer=Collect(), costs=FLAT_COSTS,
        return_dict_in_generate=True, tree_depth=3, tree_top_k=2, tree_budget=6,
    )  # fmt: skip
    assert seen[0] == [5, 6, 7, 8] and seen[-1] == "end"
    assert sum(seen[1:-1], []) == out.sequences[0, 4:].tolist()
    stats = out.speculation_stats[0]
    assert stats.accepted_lengths[0] == 1 and stats.generated_tokens == 12
    assert stats.target_calls == len(stats.tree_sizes) + 1 and stats.mean_accepted_length > 1.5
    assert stats.as_dict()["drafted_tokens"] == sum(stats.tree_sizes) > 0


# ---------------------------------------------------------------------------------------------------------------------
# Sampling: the emitted tokens follow the target's distribution
# ---------------------------------------------------------------------------------------------------------------------
def _joint_counts(target, drafter, prompt, rows=400, calls=5, **kwargs):
    counts = {}
    ids = prompt[None].expand(rows, -1)
    for call in range(calls):
        torch.manual_seed(100 + call)
        out = speculative_generate(target, drafter, ids, do_sample=True, max_new_tokens=3, **kwargs)
        for t1, t2 in out[:, prompt.shape[0] : prompt.shape[0] + 2].tolist():
            counts[(t1, t2)] = counts.get((t1, t2), 0) + 1
    return counts


def _exact_joint(target, prompt, top_k, temperature):
    def probs(ids):
        logits = target(ids[None]).logits[0, -1].detach().float() / temperature
        kth = logits.topk(top_k).values[-1]
        return logits.masked_fill(logits < kth, -float("inf")).softmax(-1)

    p1 = probs(prompt)
    joint = {}
    for t1 in p1.nonzero()[:, 0].tolist():
        p2 = probs(torch.cat([prompt, torch.tensor([t1])]))
        for t2 in p2.nonzero()[:, 0].tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


def _chi_square(counts, joint):
    n = sum(counts.values())
    assert set(counts) <= set(joint), "a token outside the target's support was emitted"
    stat, small_obs, small_exp = 0.0, 0, 0.0
    for key, p in joint.items():
        if n * p < 5:  # pool rare cells
            small_obs, small_exp = small_obs + counts.get(key, 0), small_exp + n * p
            continue
        stat += (counts.get(key, 0) - n * p) ** 2 / (n * p)
    if small_exp > 0:
        stat += (small_obs - small_exp) ** 2 / small_exp
    return stat


def _broken_accept(tokens, parents, real, scores_at, do_sample, generator=None):
    """The sibling rule without removing a rejected child's mass: NOT exact."""
    kids = [i for i, (p, r) in enumerate(zip(parents, real)) if r and p == -1]
    p = scores_at(-1, []).float().softmax(-1)
    for c in kids:
        if float(torch.rand(())) < float(p[tokens[c]]):
            return [c], int(torch.multinomial(scores_at(c, [c]).float().softmax(-1), 1))
    return [], int(torch.multinomial(p, 1))


def test_sampling_matches_the_target_distribution(monkeypatch):
    """Chi-square of the first two sampled tokens (16 joint outcomes under top_k=4) against the target's exact
    distribution; the same test rejects a deliberately wrong acceptance rule."""
    target = _peaked(scale=3.0)
    drafter = ModelTreeDrafter(target, noise=0.3)
    prompt = torch.tensor([5, 17, 33, 9])
    kwargs = dict(top_k=4, temperature=0.8, costs=FLAT_COSTS, tree_depth=2, tree_top_k=2, tree_budget=6)
    joint = _exact_joint(target, prompt, top_k=4, temperature=0.8)
    critical = 45.3  # chi-square, 20 degrees of freedom, p = 0.0002 (at most 16 cells + a pooled one here)
    stat = _chi_square(_joint_counts(target, drafter, prompt, **kwargs), joint)
    assert stat < critical, f"chi-square {stat:.1f}"
    monkeypatch.setattr(engine, "accept_path", _broken_accept)
    broken = _chi_square(_joint_counts(target, drafter, prompt, **kwargs), joint)
    assert broken > critical, f"a wrong acceptance rule went unnoticed (chi-square {broken:.1f})"


@pytest.mark.parametrize("right", [True, False])
def test_lookup_branch_joins_the_tree(right):
    """Prompt lookup's continuation is verified in the same forward as the network's tree: right or wrong, the output
    is generate's; a right one raises acceptance above the network's alone."""
    target = _peaked()
    ids = torch.tensor([[9, 8, 7, 6, 5]])
    ref = target.generate(ids, max_new_tokens=30, do_sample=False)
    continuation = ref[0].tolist() if right else [3] * 40
    lengths = {}
    for name, lookup in (("network", None), ("hybrid", continuation)):
        drafter = ModelTreeDrafter(target, noise=3.0, lookup=lookup)
        out = speculative_generate(
            target, drafter, ids, max_new_tokens=30, do_sample=False, return_dict_in_generate=True,
            costs=FLAT_COSTS, tree_depth=2, tree_top_k=2, tree_budget=4,
        )  # fmt: skip
        assert torch.equal(out.sequences, ref)
        lengths[name] = out.speculation_stats[0].mean_accepted_length
        if lookup is not None:
            assert out.speculation_stats[0].lookup_tokens > 0
    if right:
        assert lengths["hybrid"] > lengths["network"] + 1


def _counted_lookup_drafter(right: bool):
    """A peaked target, its prompt and greedy output, and a drafter whose prompt lookup always proposes (the right
    continuation or a wrong one) and whose network steps are counted in `steps`."""
    target = _peaked()
    ids = torch.tensor([[9, 8, 7, 6, 5]])
    ref = target.generate(ids, max_new_tokens=30, do_sample=False)
    drafter = ModelTreeDrafter(target, noise=3.0, lookup=ref[0].tolist() if right else [3] * 40)
    steps = []
    step = drafter.tree_step
    drafter.tree_step = lambda *args: steps.append(1) or step(*args)
    return target, ids, ref, drafter, steps


@pytest.mark.parametrize("right", [True, False])
def test_a_chain_verifies_lookup_alone_where_it_has_a_continuation(right):
    """A chain (top-k 1) drafts by prompt lookup alone where every row has a continuation, as the `assistant_model`
    path does: no drafter step that cycle (the drafter catches up later). Right or wrong, the output is generate's."""
    target, ids, ref, drafter, steps = _counted_lookup_drafter(right)
    out = speculative_generate(
        target, drafter, ids, max_new_tokens=30, do_sample=False, return_dict_in_generate=True,
        costs=FLAT_COSTS, tree_depth=3, tree_top_k=1, tree_budget=3,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    stats = out.speculation_stats[0]
    assert stats.lookup_tokens == stats.drafted_tokens > 0  # every drafted token came from lookup
    assert steps == []  # the network never drafted: lookup always had a continuation
    if right:
        assert stats.mean_accepted_length > 3  # the budget's 3 drafts and the target's token, nearly every cycle


@pytest.mark.parametrize("right", [True, False])
def test_the_lookup_arm_verifies_lookup_without_the_drafter(right):
    """The policy's lookup arm calls no drafter forward: where prompt lookup has a continuation it is verified (cut by
    cost), else the cycle decodes plainly; with lookup off there is no lookup arm. Output = generate's."""
    from moa_hf.modeling.custom_generate.policy import ShapePolicy, TreeSettings

    off = ShapePolicy(TreeSettings(), FLAT_COSTS, 1, lookup=False)
    assert off.arms == {"none": ("tree", "chain", "plain")}  # lookup off: every cycle is of context "none"
    off.sums["plain"] = [0.001, 1.0, ShapePolicy.PROBE]
    off.sums["none/tree"] = off.sums["none/chain"] = [1.0, 1.0, ShapePolicy.PROBE]
    assert off.plan(remaining=100).depth == 0  # lookup off: plain decoding
    target, ids, ref, drafter, steps = _counted_lookup_drafter(right)
    costs = Costs(verify=FLAT_COSTS.verify, step=FLAT_COSTS.step)
    slow = (1.0, 1.0)
    costs.learned = {"arms": {"found/lookup": (0.001, 1.0), "found/tree": slow, "none/tree": slow, "none/chain": slow}}
    out = speculative_generate(
        target, drafter, ids, max_new_tokens=30, do_sample=False, return_dict_in_generate=True, costs=costs
    )
    assert torch.equal(out.sequences, ref)
    stats = out.speculation_stats[0]
    cycles = out.policy["arm_cycles"]
    assert stats.lookup_tokens > 0 and cycles["found/lookup"] > 0
    assert len(steps) <= 10 * (cycles["found/tree"] + cycles["none/tree"] + cycles["none/chain"])  # probes only
    if right:
        assert stats.mean_accepted_length > 3


def test_tree_pieces():
    """add_chain merges a chain into existing nodes; a budget cut keeps a tree (every kept node's parent kept)."""
    tree = Tree(
        tokens=torch.tensor([[10, 11, 12, 13]]),
        parents=torch.tensor([[-1, -1, 0, 0]]),
        depth=torch.tensor([[1, 1, 2, 2]]),
        score=torch.tensor([[-0.1, -2.0, -0.5, -3.0]]),
        real=torch.ones(1, 4, dtype=torch.bool),
        lookup=torch.zeros(1, 4, dtype=torch.bool),
    )
    merged = add_chain(tree, [torch.tensor([10, 13, 20])], math.log(0.5))
    assert merged.tokens[0].tolist() == [10, 11, 12, 13, 20]
    assert merged.parents[0].tolist() == [-1, -1, 0, 0, 3]
    assert merged.lookup[0].tolist() == [False] * 4 + [True]
    assert merged.score[0, 3] == pytest.approx(2 * math.log(0.5))  # raised from -3.0
    for budget in range(6):
        cut = cut_to_budget(merged, budget, 64)
        parents = cut.parents[0].tolist()
        assert len(parents) == budget and all(p < i for i, p in enumerate(parents))
    # a mask: the root sees the cache's valid slots within the window and itself
    mask = tree_attention_mask(
        torch.tensor([[False, True, True]]), torch.tensor([[0, 0, 1]]), torch.tensor([[2, 3]]),
        torch.tensor([[[True, False], [True, True]]]), window=2,
    )  # fmt: skip
    assert mask[0, 0].tolist() == [[False, False, True, True, False], [False, False, False, True, True]]
    # budget None: the n that maximises expected tokens per second (here verifying is free up to 2 nodes)
    seconds = torch.tensor([1.0, 1.0, 1.0, 10.0, 10.0, 10.0])
    assert cut_to_budget(merged, None, 64, seconds).size == 2


def _random_tree(B, N, V, generator):
    """A random tree per row (parents first, distinct sibling tokens) with fillers at the end of some rows."""
    tokens = torch.zeros(B, N, dtype=torch.long)
    parents = torch.full((B, N), -1, dtype=torch.long)
    depth = torch.ones(B, N, dtype=torch.long)
    real = torch.ones(B, N, dtype=torch.bool)
    for b in range(B):
        used = {}
        for i in range(N):
            open_ = [q for q in range(-1, i) if len(used.setdefault(q, set())) < V]  # nodes with a free token
            p = open_[int(torch.randint(len(open_), (), generator=generator))]
            free = [t for t in range(V) if t not in used[p]]
            t = free[int(torch.randint(len(free), (), generator=generator))]
            used[p].add(t)
            tokens[b, i], parents[b, i] = t, p
            depth[b, i] = 1 if p < 0 else depth[b, p] + 1
        real[b, N - b :] = False  # row b: b fillers
    return tokens, parents, depth, real


def test_greedy_tree_acceptance_is_the_walk():
    """The vectorised rule (accepted iff every ancestor-or-self matches the target's argmax) gives the path and the
    next token of the node-by-node walk, on random trees whose argmax often follows a branch."""
    g = torch.Generator().manual_seed(0)
    B, N, V = 4, 12, 3
    for _ in range(50):
        tokens, parents, depth, real = _random_tree(B, N, V, g)
        argmax = torch.randint(V, (B, 1 + N), generator=g)
        anc = ancestors(parents, depth)
        for b in range(B):  # brute force ancestors
            for i in range(N):
                chain, j = set(), i
                while j >= 0:
                    chain.add(j)
                    j = int(parents[b, j])
                assert {j for j in range(N) if anc[b, i, j]} == chain
        length, path, nxt = greedy_accept_tree(tokens, parents, depth, real, anc, argmax, int(depth.max()))
        for b in range(B):
            row = argmax[b]
            walk, token = accept_path(
                tokens[b].tolist(), parents[b].tolist(), real[b].tolist(),
                lambda node, p, row=row: torch.nn.functional.one_hot(row[node + 1], V), do_sample=False,
            )  # fmt: skip
            assert int(length[b]) == len(walk) and path[b, : len(walk)].tolist() == walk and int(nxt[b]) == token
            assert (path[b, len(walk) :] == -1).all()


def test_compact_cache_moves_the_accepted_path():
    from transformers import DynamicCache

    cache = DynamicCache()
    states = torch.arange(2 * 1 * 6 * 1, dtype=torch.float).view(2, 1, 6, 1)  # [B, H, S, D]: slot ids
    cache.update(states, states.clone(), 0)
    compact_cache(cache, 2, torch.tensor([[0, 2, 3], [0, 1, 0]]))
    assert cache.layers[0].keys[:, 0, :, 0].tolist() == [[0, 1, 2, 4, 5], [6, 7, 8, 9, 8]]


def test_slot_cache_records_the_prompt_and_the_accepted_paths():
    """`SlotCache`: the prompt's slots as they are, then per row the root and its accepted path moved next to them
    (keys/values, validity, positions, hidden states), the masks over them, a rollback, a row selection."""
    slots = SlotCache(2, "cpu", {"full_attention": None}, keep_hidden=True)
    prompt = torch.arange(6, dtype=torch.float).view(2, 1, 3, 1)  # [B, H, P, D]: slot ids
    slots.cache.update(prompt, prompt.clone(), 0)
    slots.prefill(torch.tensor([[False, True, True], [True, True, True]]), torch.tensor([[0, 0, 1], [0, 1, 2]]),
                  prompt[:, 0])  # fmt: skip
    tree = 100 + torch.arange(8, dtype=torch.float).view(2, 1, 4, 1)  # [B, H, 1+N, D]: a verification's [root, tree]
    slots.cache.update(tree, tree.clone(), 0)
    slots.commit(torch.tensor([[0, 2, 3], [0, 1, 0]]), torch.tensor([2, 1]), torch.tensor([2, 3]), tree[:, 0])
    assert slots.width == 6 and slots.cache.layers[0].keys[:, 0, :, 0].tolist() == [
        [0, 1, 2, 100, 102, 103],
        [3, 4, 5, 104, 105, 104],
    ]
    assert slots.valid.tolist() == [[False, True, True, True, True, True], [True, True, True, True, True, False]]
    assert slots.pos.tolist() == [[0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]]
    assert slots.hidden[:, :, 0].tolist() == [[0, 1, 2, 100, 102, 103], [3, 4, 5, 104, 105, 104]]
    mask = slots.masks(torch.tensor([[5], [6]]), torch.ones(2, 1, 1, dtype=torch.bool))  # [B, 1, 1, S+1]
    assert mask[:, 0, 0].tolist() == [[False, True, True, True, True, True, True], [True] * 5 + [False, True]]
    slots.cache.update(prompt[:, :, :2], prompt[:, :, :2], 0)  # two dummy tokens, then dropped
    slots.rollback()
    slots.select_rows(torch.tensor([1]))
    assert slots.cache.layers[0].keys[:, 0, :, 0].tolist() == [[3, 4, 5, 104, 105, 104]]
    assert slots.valid.tolist() == [[True] * 5 + [False]] and slots.hidden.shape == (1, 6, 1)


def test_bad_settings_say_what_to_do():
    with pytest.raises(ValueError, match="tree_depth"):
        TreeSettings(depth=0)
    target = _peaked()
    with pytest.raises(ValueError, match="attn_implementation"):
        target.config._attn_implementation = "flex_attention"
        speculative_generate(target, ModelTreeDrafter(target), torch.tensor([[3, 4]]), max_new_tokens=3)


# -- the shape policy's arms ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "context,best", [("none", "tree"), ("none", "chain"), ("none", "plain"), ("found", "tree"), ("found", "lookup")]
)
def test_shape_policy_plays_the_arm_that_measured_fastest(context, best):
    from moa_hf.modeling.custom_generate.policy import ShapePolicy, TreeSettings

    policy = ShapePolicy(TreeSettings(), FLAT_COSTS, batch=1, lookup=True)
    arms = policy.arms[context]
    assert arms == {"none": ("tree", "chain", "plain"), "found": ("tree", "lookup")}[context]
    rates = dict.fromkeys(arms, 0.010)
    rates[best] = 0.006
    played = drive_engine(policy, World(arm_s=rates), 300, context)
    assert set(played[: len(arms) * ShapePolicy.PROBE]) == set(arms)  # every arm probed first
    assert played[-100:].count(best) >= 85  # then the best, probing the others now and then
    other = next(a for a in arms if a != best)
    assert 0 < played[100:].count(other) < 20
    key = ShapePolicy.key(context, best)
    assert policy.summary()["arm_ms_per_token"][key] == pytest.approx(6.0)


def test_shape_policy_keeps_rates_per_context():
    """Cycles with a lookup continuation for every row ("found") and without ("none") keep their arms' rates apart:
    lookup that pays where it has a continuation is played there while plain decoding wins elsewhere. At batch 1
    there is no plain arm beside lookup's (its cut is plain decoding where lookup does not pay); a batch's cut keeps
    as many nodes for every row, so there plain decoding is measured beside lookup (and lookup plays where some
    rows have no continuation)."""
    from moa_hf.modeling.custom_generate.policy import ShapePolicy, TreeSettings

    policy = ShapePolicy(TreeSettings(), FLAT_COSTS, batch=1, lookup=True)
    found, none = [], []
    for _ in range(150):
        found += drive_engine(policy, World(arm_s={"lookup": 0.005, "tree": 0.02}), 1, "found")
        none += drive_engine(policy, World(arm_s={"tree": 0.03, "chain": 0.03, "plain": 0.01}), 1, "none")
    assert found[-50:].count("lookup") >= 45 and none[-50:].count("plain") >= 45
    rates = policy.summary()["arm_ms_per_token"]
    assert rates["found/lookup"] == pytest.approx(5.0) and rates["plain"] == pytest.approx(10.0)
    assert ShapePolicy(TreeSettings(), FLAT_COSTS, batch=4, lookup=True).arms == {  # plain measured beside lookup
        "found": ("tree", "lookup", "plain"),
        "none": ("tree", "chain", "lookup", "plain"),
    }
    assert ShapePolicy.context_of([[1, 2], [3]]) == "found"
    assert ShapePolicy.context_of([[1, 2], None]) == ShapePolicy.context_of(None) == "none"


def test_verify_fit_follows_the_cost_of_more_tokens():
    """The verification table's one-token cost and its further tokens' cost are fitted separately: a context where
    each more token costs twice the table's (and the first 1.2x) is priced so, and the cut follows it."""
    from moa_hf.modeling.custom_generate.policy_core import VerifyFit

    costs = Costs(verify={1: 0.04, 8: 0.05, 64: 0.12}, step={1: 0.003})
    fit = VerifyFit(costs.verify_cost)
    assert fit.seconds(8)[-1] == pytest.approx(0.05)
    for n in [1, 4, 8, 16, 2, 12] * 10:
        fit.update(n, 1.2 * costs.verify_cost(1) + 2.0 * (costs.verify_cost(n) - costs.verify_cost(1)))
    assert fit.base == pytest.approx(1.2, rel=0.05) and fit.extra == pytest.approx(2.0, rel=0.05)
    assert fit.seconds(8)[-1] == pytest.approx(1.2 * 0.04 + 2.0 * 0.01, rel=0.05)
    for _ in range(50):  # only plain steps lately: both scale alike, no division by nothing
        fit.update(1, 0.05)
    assert math.isfinite(fit.base) and math.isfinite(fit.extra) and fit.base == pytest.approx(1.25, rel=0.05)


def test_shape_policy_probes_a_far_slower_arm_rarely():
    from moa_hf.modeling.custom_generate.policy import ShapePolicy, TreeSettings

    policy = ShapePolicy(TreeSettings(), FLAT_COSTS, batch=1, lookup=True)
    slow_plain = World(arm_s={"tree": 0.010, "chain": 0.011, "plain": 0.040})  # plain 4x slower
    played = drive_engine(policy, slow_plain, 300)[50:]
    assert 0 < played.count("plain") <= 250 // ShapePolicy.MAX_EXPLORE_GAP + 1  # once per gap at most
    assert played.count("chain") >= 2 * played.count("plain")  # an arm close to the best is looked at more often


def test_shape_policy_probes_a_losing_arm_less_and_less():
    """Each probe after which an arm is still slower than another doubles its interval (up to 2^MAX_BACKOFF x); the
    next call starts one doubling lower; a probe it wins resets it."""
    from moa_hf.modeling.custom_generate.policy import ShapePolicy, TreeSettings

    policy = ShapePolicy(TreeSettings(), FLAT_COSTS, batch=1, lookup=True)
    played = drive_engine(policy, World(arm_s={"tree": 0.0105, "chain": 0.020, "plain": 0.010}), 900)  # in margin
    probes = [i for i, arm in enumerate(played) if arm == "tree"][ShapePolicy.PROBE :]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(gaps) >= 4 and gaps[1] >= 1.9 * gaps[0] and gaps[2] >= 1.9 * gaps[1]  # doubled per lost probe
    assert gaps[-1] == gaps[-2]  # up to 2^MAX_BACKOFF x
    assert policy.learned()["losses"]["none/tree"] >= ShapePolicy.MAX_BACKOFF
    carried = ShapePolicy(TreeSettings(), FLAT_COSTS, batch=1, lookup=True, carried=policy.learned())
    assert carried.probes.losses["none", "tree"] == policy.probes.losses["none", "tree"] - 1
    played = drive_engine(carried, World(arm_s={"tree": 0.005, "chain": 0.020, "plain": 0.010}), 400)  # tree fastest
    assert played[-100:].count("tree") >= 85 and carried.probes.losses.get(("none", "tree"), 0) == 0


def test_shape_policy_counts_an_arms_interval_across_calls():
    """An arm's interval may be longer than a call: the cycles since it last played carry over, so it is probed in a
    later call instead of never (each call restarting the count)."""
    from moa_hf.modeling.custom_generate.policy import ShapePolicy, TreeSettings

    rates = {"lookup": 0.030, "tree": 0.010}  # lookup 3x slower: interval 144 cycles
    first = ShapePolicy(TreeSettings(), FLAT_COSTS, batch=1, lookup=True)
    assert drive_engine(first, World(arm_s=rates), 30, "found").count("lookup") == ShapePolicy.PROBE
    second = ShapePolicy(TreeSettings(), FLAT_COSTS, batch=1, lookup=True, carried=first.learned())
    assert "lookup" in drive_engine(second, World(arm_s=rates), 120, "found")  # 30 + 120 > 144 cycles since it played
    fresh = ShapePolicy(TreeSettings(), FLAT_COSTS, batch=1, lookup=True, carried={"arms": first.learned()["arms"]})
    assert "lookup" not in drive_engine(fresh, World(arm_s=rates), 120, "found")  # from the call's start: 144 to wait


def test_shape_policy_leaves_the_drafter_off_where_the_network_lost():
    """A call whose predecessors measured every network arm far behind the best does not start the drafter (no
    network arm); one within `START_MARGIN` does; every `REFRESH_CALLS`-th call measures the network again."""
    from moa_hf.modeling.custom_generate.policy import ShapePolicy, TreeSettings

    first = ShapePolicy(TreeSettings(), FLAT_COSTS, batch=8, lookup=True)
    assert first.network  # nothing measured yet
    drive_engine(first, World(arm_s={"tree": 0.030, "chain": 0.020, "lookup": 0.012, "plain": 0.010}), 200)
    carried = first.learned()
    assert carried["idle_calls"] == 0  # the network played (probes)
    idle = 0
    for _ in range(2 * ShapePolicy.REFRESH_CALLS):
        policy = ShapePolicy(TreeSettings(), FLAT_COSTS, batch=8, lookup=True, carried=carried)
        played = drive_engine(policy, World(arm_s={"tree": 0.03, "chain": 0.02, "lookup": 0.012, "plain": 0.01}), 50)
        assert policy.network == (idle >= ShapePolicy.REFRESH_CALLS)
        assert policy.network or not {"tree", "chain"} & set(played)
        carried = policy.learned()
        idle = carried["idle_calls"]
    close = ShapePolicy(TreeSettings(), FLAT_COSTS, batch=8, lookup=True, carried=first.learned())
    close.sums["none/chain"] = [0.0105, 1.0, ShapePolicy.PROBE]
    assert ShapePolicy(TreeSettings(), FLAT_COSTS, 8, True, close.learned()).network  # within the margin


def test_shape_policy_keeps_rates_per_rows_still_decoding():
    """When rows finish, rates measured with more rows are not compared with rates at fewer: the count of rows still
    decoding keeps its own rates (`key@rows`), each arm starting from its former rate x (former / rows rows)."""
    from moa_hf.modeling.custom_generate.policy import ShapePolicy, TreeSettings

    policy = ShapePolicy(TreeSettings(), FLAT_COSTS, batch=4, lookup=False)
    played = drive_engine(policy, World(arm_s={"tree": 0.006, "chain": 0.010, "plain": 0.010}), 100, rows=4)
    assert played[-30:].count("tree") >= 25
    played = drive_engine(policy, World(arm_s={"tree": 0.030, "chain": 0.030, "plain": 0.015}), 200, rows=2)
    assert played[-50:].count("plain") >= 45
    rates = policy.summary()["arm_ms_per_token"]
    assert rates["none/tree"] == pytest.approx(6.0) and rates["plain"] == pytest.approx(10.0)  # kept at 4 rows
    assert rates["plain@2"] == pytest.approx(15.0) and rates["none/tree@2"] > 15.0
    assert ShapePolicy(TreeSettings(), FLAT_COSTS, 4, False, policy.learned()).sums["plain@2"][1] == 1.0  # carried


def test_shape_policy_follows_an_arm_that_becomes_slower():
    from moa_hf.modeling.custom_generate.policy import ShapePolicy, TreeSettings

    policy = ShapePolicy(TreeSettings(), FLAT_COSTS, batch=1, lookup=True)
    drive_engine(policy, World(arm_s={"tree": 0.005, "chain": 0.008, "plain": 0.010}), 60)
    played = drive_engine(policy, World(arm_s={"tree": 0.015, "chain": 0.008, "plain": 0.010}), 200)  # context grew
    assert played[-100:].count("chain") >= 85


def test_shape_policy_fixed_shapes_and_carried_rates():
    from moa_hf.modeling.custom_generate.policy import ShapePolicy, TreeSettings

    fixed = ShapePolicy(TreeSettings(depth=3, top_k=2, budget=8), FLAT_COSTS, batch=1, lookup=False)
    assert set(drive_engine(fixed, World(arm_s={"fixed": 0.02}), 30)) == {"fixed"}  # never decodes plainly
    top1 = ShapePolicy(TreeSettings(top_k=1), FLAT_COSTS, batch=1, lookup=True)
    assert top1.arms == {"none": ("fixed", "plain"), "found": ("fixed", "lookup")}
    first = ShapePolicy(TreeSettings(), FLAT_COSTS, batch=1, lookup=True)
    drive_engine(first, World(arm_s={"tree": 0.004, "chain": 0.008, "plain": 0.010}), 40)
    one = torch.ones(1, 1, dtype=torch.long)
    node = Tree(one, one * -1, one, torch.zeros(1, 1), one.bool(), one.bool())
    first.update(node, [0], [(10, 10, 16)] * 100 + [(1, 0, 2)] * 100, 0.01, 0.0, 0.0)  # long ones right, short wrong
    assert (
        first.lookup_log_probs(1, length=16)[0]
        > math.log(0.9)
        > math.log(0.1)
        > first.lookup_log_probs(1, length=2)[0]
    )
    carried = first.learned()
    assert carried["arms"]["none/tree"][0] / carried["arms"]["none/tree"][1] == pytest.approx(0.004, rel=0.2)
    warm = ShapePolicy(TreeSettings(), FLAT_COSTS, batch=1, lookup=True, carried=carried)
    long = warm.lookup_rates.length_class(16)  # rates carried (weighted) per class of proposal length
    assert warm.lookup_log_probs(5, length=16)[-1] > first.lookup_log_probs(5, length=16)[-1] - 0.2
    assert warm.lookup_log_probs(1, length=2)[0] < math.log(0.2)
    assert warm.lookup_rates.tried[long][0] == ShapePolicy.CARRIED_TRIES
    played = drive_engine(warm, World(arm_s={"tree": 0.004, "chain": 0.008, "plain": 0.01}), 5)
    assert played == ["tree"] * 5  # no probes
