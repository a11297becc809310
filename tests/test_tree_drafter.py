"""The drafters' tree API (what the engine of custom_generate/engine.py calls): `tree_catch_up` and `tree_step` give,
for every tree node, the logits of the chain path (`_prepare_draft` + `next_logits`) along that node's path, for each
row of a left-padded batch as for itself alone, across cycles (`tree_end` + a catch-up with the accepted tokens) and
after `tree_select_rows`; and the one chain-drafting loop (`draft_chain`): on a tree state (`tree_chain`, the vLLM
proposer's) it drafts the tokens of `build_tree` at top-k 1 and of assisted generation's drafting, row by row."""

import random

import pytest
import torch
from transformers import DynamicCache

import moa_hf
from moa_hf.modeling.chain import draft_chain
from moa_hf.modeling.configuration_eagle import EagleDrafterConfig
from moa_hf.modeling.custom_generate.tree import build_tree
from moa_hf.modeling.modeling_eagle import EagleDrafterModel

from factory import make_target
from tolerance import assert_close

TREE = [[-1, -1], [0, 0, 1], [2, 4]]  # parents per depth: root -> a, b; a -> c, d; b -> e; c -> f; e -> g


@pytest.fixture(params=["moa", "moa-hidden", "moa-latest", "moa-sorted-latest", "moa-tli", "eagle"])
def setup(request):
    """A tiny target and an attached drafter of each kind with weights large enough that every masked-out entry (a
    sibling, another row's padding, a dropped node) would change the logits."""
    target = make_target("llama")
    torch.manual_seed(0)
    if request.param.startswith("moa"):  # hidden: the context reads the final hidden states; latest: the CA's input
        # adds the newest verified context (`context_final_hidden`, `ca_latest_context`)
        hidden, latest = request.param == "moa-hidden", request.param.endswith("latest")
        options = {"num_blocks": 2, "exit_thresholds": [0.1]} if "sorted" in request.param else {}
        if request.param == "moa-tli":  # the target's last layer runs on the drafter's feature
            options["target_layer_inference"] = 1
        drafter = moa_hf.build_drafter(target, context_final_hidden=hidden, ca_latest_context=latest, **options)
    else:
        drafter = EagleDrafterModel(EagleDrafterConfig.from_target_config(target.config, num_hidden_layers=2))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    with drafter.eval().attached(target):
        yield target, drafter


def _target_states(target, seqs):
    """The target run over the left-padded `seqs`: its cache (slot = column), final hidden states [B, T, d], T."""
    T = max(map(len, seqs))
    ids = torch.tensor([[0] * (T - len(s)) + s for s in seqs])  # [B, T]
    mask = (torch.arange(T)[None] >= torch.tensor([T - len(s) for s in seqs])[:, None]).long()  # [B, T]
    cache = DynamicCache()
    with torch.no_grad():
        out = target(
            ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(1) - 1).clamp(min=0),
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )
    return cache, out.hidden_states[-1], T


def _catch_up(target, drafter, state, seqs, starts, g):
    """`tree_catch_up` with the tokens of positions starts[b]: of each row's verified sequence, as the engine passes
    them (right-aligned; prev_slots where the target's state of the previous token lives; garbage in the padding)."""
    cache, hidden, T = _target_states(target, seqs)
    B, n = len(seqs), max(len(s) - a for s, a in zip(seqs, starts))
    tokens = torch.randint(3, 128, (B, n), generator=g)
    positions = torch.randint(0, 50, (B, n), generator=g)
    valid = torch.zeros(B, n, dtype=torch.bool)
    prev_slots = torch.full((B, n), -1)
    prev_hidden = torch.randn(B, n, hidden.shape[-1], generator=g)  # the drafter must ignore it where slot is -1
    for b, (seq, a) in enumerate(zip(seqs, starts)):
        m, pos = len(seq) - a, torch.arange(a, len(seq))
        tokens[b, n - m :], positions[b, n - m :], valid[b, n - m :] = torch.tensor(seq[a:]), pos, True
        slots = T - len(seq) + pos - 1  # the column of position pos-1 in the target's run
        prev_slots[b, n - m :] = torch.where(pos > 0, slots, -1)
        prev_hidden[b, n - m :] = torch.where((pos > 0)[:, None], hidden[b, slots.clamp(min=0)], 0.0)
    logits = drafter.tree_catch_up(
        state, tokens, positions, valid, prev_slots, cache, prev_hidden if drafter.needs_target_hidden else None
    )
    assert logits.shape == (B, 128) and logits.dtype == torch.float32
    return logits


def _chain(target, drafter, seq, path=()):
    """The chain path's logits [V] after the verified `seq` and the drafted `path`."""
    ids = torch.tensor([seq])
    with torch.no_grad():
        target(ids[:, :-1], past_key_values=DynamicCache(), use_cache=True)  # the hooks see it, as in generate
        next_logits, _ = drafter._prepare_draft(ids, drafter.new_cache(), len(path) + 1, 0)
        logits = next_logits(None)
        for token in path:
            logits = next_logits(torch.tensor([[token]]))
    return logits[0]


class _Tree:
    """A tree fed depth by depth with `tree_step` after roots at `root_pos` [B]: each node's token, parent, depth and
    logits, per row."""

    def __init__(self, drafter, state, root_pos, g):
        self.drafter, self.state, self.root_pos, self.g = drafter, state, root_pos, g
        self.tokens, self.parents, self.depths = (torch.zeros(len(root_pos), 0, dtype=torch.long) for _ in range(3))
        self.logits = torch.zeros(len(root_pos), 0, 128)

    def step(self, parents: torch.Tensor) -> None:
        depth = int(self.depths.max()) + 1 if self.depths.numel() else 1
        tokens = torch.randint(3, 128, parents.shape, generator=self.g)
        positions = (self.root_pos[:, None] + depth).expand_as(tokens)
        logits = self.drafter.tree_step(self.state, tokens, positions, parents)
        assert logits.shape == (*parents.shape, 128) and torch.isfinite(logits.nan_to_num(neginf=0)).all()
        self.tokens, self.parents = torch.cat([self.tokens, tokens], 1), torch.cat([self.parents, parents], 1)
        self.depths = torch.cat([self.depths, torch.full_like(tokens, depth)], 1)
        self.logits = torch.cat([self.logits, logits], 1)

    def select(self, rows: torch.Tensor) -> None:
        self.drafter.tree_select_rows(self.state, rows)
        for name in ("root_pos", "tokens", "parents", "depths", "logits"):
            setattr(self, name, getattr(self, name)[rows])

    def paths(self, b: int) -> list:
        """Row b's path (tokens after the root) of every node, None for a filler (parent -1 below depth 1)."""
        paths = []
        for token, parent, depth in zip(self.tokens[b].tolist(), self.parents[b].tolist(), self.depths[b].tolist()):
            if parent < 0:
                paths.append([token] if depth == 1 else None)
            else:
                paths.append(None if paths[parent] is None else [*paths[parent], token])
        return paths

    def check(self, target, seqs) -> None:
        for b, seq in enumerate(seqs):
            for i, path in enumerate(self.paths(b)):
                if path is not None:
                    want = _chain(target, self.drafter, seq, path)
                    assert_close(self.logits[b, i], want, msg=f"row {b} {path}")


def _prompts(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 128) for _ in range(n)] for n in lengths]


def _parents(depth: int, batch: int) -> torch.Tensor:
    """TREE's parents at `depth` for every row, with a filler node (parent -1) in the last depth of row 1."""
    parents = torch.tensor(TREE[depth]).expand(batch, -1).clone()
    if batch > 1 and depth == len(TREE) - 1:
        parents[1, -1] = -1
    return parents


@pytest.mark.parametrize("lengths", [(8,), (6, 11, 3)])
def test_catch_up_and_tree_nodes_equal_the_chain(setup, lengths):
    """(1) the catch-up's logits after prompt + first token, (2) every node of a tree, (3) per row of a left-padded
    batch: the chain's logits after the same verified tokens and the node's path, also after tree steps that were
    forgotten (`tree_end`: the engine times the drafter's steps on the caught-up state first)."""
    target, drafter = setup
    g = torch.Generator().manual_seed(len(lengths))
    seqs = _prompts(lengths, seed=len(lengths))
    state = drafter.tree_start(len(seqs))
    logits = _catch_up(target, drafter, state, seqs, [0] * len(seqs), g)
    for b, seq in enumerate(seqs):
        assert_close(logits[b], _chain(target, drafter, seq))
    root_pos = torch.tensor([len(s) - 1 for s in seqs])[:, None]
    for width in (1, 3):  # timing probes: nodes at depth 1, dropped again
        probe = torch.randint(3, 128, (len(seqs), width), generator=g)
        drafter.tree_step(state, probe, (root_pos + 1).expand_as(probe), torch.full_like(probe, -1))
        drafter.tree_end(state)
    tree = _Tree(drafter, state, torch.tensor([len(s) - 1 for s in seqs]), g)
    for depth in range(len(TREE)):
        tree.step(_parents(depth, len(seqs)))
    tree.check(target, seqs)


def test_cycles_with_accepted_tokens_equal_a_fresh_chain(setup):
    """(4) after `tree_end`, a catch-up with each row's accepted path + the target's new token (rows accept different
    numbers of tokens) drafts as a fresh chain over the longer verified sequences, cycle after cycle."""
    target, drafter = setup
    g, rng = torch.Generator().manual_seed(1), random.Random(1)
    seqs = _prompts((5, 9), seed=1)
    state, starts = drafter.tree_start(len(seqs)), [0, 0]
    for cycle in range(3):
        logits = _catch_up(target, drafter, state, seqs, starts, g)
        for b, seq in enumerate(seqs):
            assert_close(logits[b], _chain(target, drafter, seq))
        tree = _Tree(drafter, state, torch.tensor([len(s) - 1 for s in seqs]), g)
        for depth in range(len(TREE)):
            tree.step(_parents(depth, len(seqs)))
        tree.check(target, seqs)
        drafter.tree_end(state)
        starts = [len(s) for s in seqs]
        accepted = [rng.choice([[], *[p for p in tree.paths(b) if p]]) for b in range(len(seqs))]
        accepted[cycle % 2] = max((p for p in tree.paths(cycle % 2) if p), key=len)  # one row accepts a long path
        seqs = [s + a + [rng.randrange(3, 128)] for s, a in zip(seqs, accepted)]


def test_select_rows_keeps_rows(setup):
    """(5) `tree_select_rows` in the middle of a tree and between cycles keeps the chosen rows, in that order."""
    target, drafter = setup
    g = torch.Generator().manual_seed(2)
    seqs = _prompts((7, 4, 10), seed=2)
    state = drafter.tree_start(3)
    _catch_up(target, drafter, state, seqs, [0, 0, 0], g)
    tree = _Tree(drafter, state, torch.tensor([len(s) - 1 for s in seqs]), g)
    tree.step(_parents(0, 3))
    parents = _parents(1, 3)
    parents[2] = torch.tensor([1, 1, 0])  # row 2's tree differs from row 0's: b -> c, d; a -> e
    tree.step(parents)
    tree.select(torch.tensor([2, 0]))
    seqs = [seqs[2], seqs[0]]
    tree.step(_parents(2, 2))
    tree.check(target, seqs)
    drafter.tree_end(state)
    drafter.tree_select_rows(state, torch.tensor([1]))
    seq = seqs[1] + tree.paths(1)[2] + [5]  # the kept row accepted node c (path a, c), then the target's token 5
    logits = _catch_up(target, drafter, state, [seq], [len(seqs[1])], g)
    assert_close(logits[0], _chain(target, drafter, seq))


def test_tree_chain_drafts_the_tokens_of_a_top_k_1_tree_and_of_assisted_generation(setup):
    """(6) greedy chains on a caught-up tree state (`tree_chain`) are the tokens of `build_tree` at top-k 1 on the
    same state, and per row those of the assisted-generation drafting loop over that row's verified tokens alone."""
    target, drafter = setup
    seqs, depth = _prompts((6, 11, 3), seed=3), 5
    states = [drafter.tree_start(len(seqs)) for _ in range(2)]
    roots = [_catch_up(target, drafter, s, seqs, [0] * len(seqs), torch.Generator().manual_seed(3)) for s in states]
    root_pos = torch.tensor([len(s) - 1 for s in seqs])  # [B]
    tree = build_tree(drafter, states[0], roots[0], root_pos, depth, top_k=1)
    chain = drafter.tree_chain(states[1], roots[1], root_pos + 1, depth)
    assert tree.tokens.shape == chain.tokens.shape == (len(seqs), depth)
    assert torch.equal(chain.tokens, tree.tokens) and chain.lengths == [depth] * len(seqs)
    for b, seq in enumerate(seqs):
        ids = torch.tensor([seq])
        with torch.no_grad():
            target(ids[:, :-1], past_key_values=DynamicCache(), use_cache=True)  # the hooks see it, as in generate
            next_logits, _ = drafter._prepare_draft(ids, drafter.new_cache(), depth, 0)
            alone = draft_chain(next_logits, depth, ids=ids)
        assert alone.tokens[0].tolist() == chain.lists()[b] and alone.ids.shape == (1, len(seq) + depth)


def test_draft_chain_stops_each_row_at_its_first_stop():
    """`draft_chain` over a scripted drafter: a row stops after an EOS (masked while fewer than `min_tokens` were
    drafted) or after a token below the threshold, keeps that token, and the loop ends when every row has stopped."""
    V, eos = 6, 5
    script = [  # per call, per row: the drafter's logits that are not 0
        [{eos: 9.0, 4: 5.0}, {1: 9.0}, {2: 9.0}],
        [{3: 9.0}, {1: 0.5}, {2: 9.0}],  # row 1: its token's probability 0.25 < 0.5
        [{eos: 9.0}, {4: 9.0}, {3: 9.0}],
        [{1: 9.0}, {1: 9.0}, {4: 0.5}],
        *[[{1: 9.0}] * 3] * 2,
    ]
    calls = []

    def next_logits(token):
        calls.append(None if token is None else token[:, 0].tolist())
        logits = torch.zeros(3, V)
        for b, row in enumerate(script[len(calls) - 1]):
            for t, value in row.items():
                logits[b, t] = value
        return logits

    chain = draft_chain(next_logits, 6, eos=torch.tensor([eos]), threshold=0.5, min_tokens=1)
    assert chain.lists() == [[4, 3, eos], [1, 1], [2, 2, 3, 4]]  # row 0's first EOS was masked (min_tokens)
    assert chain.lengths == [3, 2, 4] and len(chain.scores) == len(calls) == 4  # every row stopped
    assert calls[1:] == [[4, 1, 2], [3, 1, 2], [eos, 4, 3]] and chain.scores[0][0, eos] == -float("inf")
    one = draft_chain(lambda token: torch.tensor([[0.0, 1.0, 0, 0, 0, 9.0]]), 6, eos=torch.tensor([eos]))
    assert one.lists() == [[eos]] and one.lengths == [1]


def test_flags_and_unsupported_drafters():
    target = make_target("llama")
    assert EagleDrafterModel.needs_target_hidden and not moa_hf.build_drafter(target).needs_target_hidden
    assert moa_hf.build_drafter(target, context_final_hidden=True).needs_target_hidden  # reads `prev_hidden`
    assert moa_hf.build_drafter(target).tree_unsupported_reason() is None
    assert moa_hf.build_drafter(target, target_layer_inference=1).tree_unsupported_reason() is None
    with pytest.raises(RuntimeError, match="attach"):
        moa_hf.build_drafter(target).tree_start(1)  # the borrowed embedding needs the target
