"""Sorted MoA drafters (S2D, issue 20): K blocks with an exit each, adaptive depth, several targets with parts of
their own. The chain (`draft_step` / `assistant_model`) and tree (`tree_catch_up` / `tree_step`) paths draft, at a
fixed exit and adaptively, exactly the logits the parallel training `forward` gives at the exit each token left at
(the deeper blocks catch up lazily on the tokens that left before them); drafting stays lossless for every target."""

import copy
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from test_engine import FLAT_COSTS
from test_tree_drafter import TREE, _catch_up, _chain, _parents, _prompts, _Tree
from transformers import AutoModel, DynamicCache

import moa_hf
from moa_hf import MoADrafterModel
from moa_hf.modeling import (
    PRIMARY_TARGET,
    MoABlock,
    MoATargetParts,
    TargetStates,
    fixed_exit_thresholds,
    gather_target_kv,
)

from factory import make_target, sorted_drafter
from tolerance import assert_close

K = 3


def _perturbed(target, seed=1, noise=0.02):
    """Another model of the target's signature: its weights plus noise (a stand-in for a fine-tune)."""
    other = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    other.config.name_or_path = f"{target.config.name_or_path}-tuned{seed}"
    return other


def _two_target_drafter(target, tuned, lora_rank=2, **overrides):
    """A random sorted drafter for `target` with `tuned` added as "tuned" (random LoRA deltas, LSA projection)."""
    drafter = sorted_drafter(target, K, lsa_hidden_size=32, **overrides)
    drafter.add_target("tuned", tuned, lora_rank=lora_rank)
    with torch.no_grad():
        for p in drafter.target_part_parameters("tuned"):
            p.normal_(0.0, 0.2)
    return drafter


def _top(logits):
    return logits.float().softmax(-1).amax(-1)


# ---------------------------------------------------------------------------------------------- config, weights
def test_config_validation_and_fixed_thresholds():
    assert fixed_exit_thresholds(1, 3) == [0.0, 0.0] and fixed_exit_thresholds(3, 3) == [2.0, 2.0]
    assert fixed_exit_thresholds(2, 3) == [2.0, 0.0] and fixed_exit_thresholds(1, 1) == []
    target = make_target("llama")
    with pytest.raises(ValueError, match="num_blocks - 1 = 2"):
        moa_hf.build_drafter(target, num_blocks=3, exit_thresholds=[0.5])
    with pytest.raises(ValueError, match="target_layer_inference=0"):
        moa_hf.build_drafter(target, num_blocks=2, target_layer_inference=1)
    with pytest.raises(ValueError, match="identifier other than 'main'"):
        moa_hf.build_drafter(target, extra_targets={"main": {"lora_rank": 0}})
    drafter = sorted_drafter(target, K)
    drafter.config.exit_thresholds = [0.5]  # read at every drafting step: checked there
    with drafter.attached(target), pytest.raises(ValueError, match="exit_thresholds"):
        drafter.draft_step(torch.tensor([[5, 6]]), drafter.new_cache())


def test_one_block_keeps_state_dict_keys(tmp_path):
    """num_blocks=1 is today's drafter: the shipped default drafter loads with no missing or unexpected key, and a
    K=1 drafter has no block or target-part key."""
    loaded, info = MoADrafterModel.from_pretrained(moa_hf.default_drafter_path(), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    keys = moa_hf.build_drafter(make_target("llama")).state_dict().keys()
    assert not any(k.startswith(("blocks.", "target_parts.")) for k in keys)
    assert {k.split(".")[0] for k in keys} == {"self_attention", "cross_attention", "layer_self_attention", "Ekv2E"}


def test_warm_start_from_fewer_blocks(tmp_path):
    """from_pretrained(K=1 folder, num_blocks=3): loaded weights untouched, the new blocks start as the identity
    (every exit equals exit 1); a K=3 checkpoint's deeper blocks load as saved (nothing re-initialised)."""
    target = make_target("llama")
    one = sorted_drafter(target, 1)
    one.save_pretrained(tmp_path / "k1")
    three, info = MoADrafterModel.from_pretrained(tmp_path / "k1", num_blocks=3, output_loading_info=True)
    assert three.config.num_blocks == 3 and len(three.blocks) == 2 and isinstance(three.blocks[0], MoABlock)
    assert info["missing_keys"] and all(k.startswith("blocks.") for k in info["missing_keys"])
    for name, value in one.state_dict().items():
        assert torch.equal(value, three.state_dict()[name]), name
    assert all(not three.blocks[i].self_attention.self_attn.o_proj.weight.any() for i in range(2))
    assert three.blocks[0].self_attention.self_attn.q_proj.weight.any()  # the rest is random
    ids = torch.randint(3, 128, (2, 13))
    target_kv = gather_target_kv(target(ids, past_key_values=DynamicCache()).past_key_values, 0, 13)
    with three.eval().attached(target):
        out = three(ids, target_kv=target_kv, exits="all")
    with one.attached(target):
        ref = one(ids, target_kv=target_kv).logits
    assert len(out.exit_logits) == 3 and len(out.exit_hidden_states) == 3 and out.logits is out.exit_logits[-1]
    for logits in out.exit_logits:
        assert torch.equal(logits, ref)
    trained = sorted_drafter(target, 3)
    trained.save_pretrained(tmp_path / "k3")
    again = MoADrafterModel.from_pretrained(tmp_path / "k3")
    for name, value in trained.state_dict().items():
        assert torch.equal(value, again.state_dict()[name]), name


def test_forward_exits_and_one_block_outputs():
    target = make_target("llama")
    drafter = sorted_drafter(target, K)
    ids = torch.randint(3, 128, (2, 9))
    target_kv = gather_target_kv(target(ids, past_key_values=DynamicCache()).past_key_values, 0, 9)
    with drafter.attached(target):
        every = drafter(ids, target_kv=target_kv)  # exits="all" by default
        last = drafter(ids, target_kv=target_kv, exits="last")
    assert len(every.exit_logits) == K and every.exit_logits[0].shape == (2, 9, 128)
    assert last.exit_logits is None and torch.equal(last.logits, every.logits)
    assert not torch.allclose(every.exit_logits[0], every.exit_logits[-1])
    one = moa_hf.build_drafter(target).eval()
    with one.attached(target):
        out = one(ids, target_kv=target_kv)
    assert out.exit_logits == (out.logits,) and out.exit_hidden_states == (out.hidden_states,)


# ---------------------------------------------------------------------------------------------- chain drafting
def _simulate_chain(drafter, target, seed, T=28):
    """Drafting cycles as assisted generation runs them on the sequence `ids` (right or wrong drafted tokens,
    rejections rolled back): each `draft_step`'s logits, position, the SA tokens and `cycle_starts` it saw, and the
    exit it left at (from the session's `exit_counts`)."""
    rng = random.Random(seed)
    ids = torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(seed))
    target_kv = gather_target_kv(target(ids, past_key_values=DynamicCache()).past_key_values, 0, T)
    context = drafter.compute_context(TargetStates(target_kv))  # [1, T, d]: the target's states of the real tokens
    cache, records, n = drafter.new_cache(), [], 3  # n: verified tokens
    starts = []  # per SA slot p: its CA reads the context of positions < this (what a chain's step must show it)
    drafter._start_session()

    def step(new_ids):
        before = list(drafter._session.exit_counts)
        past, M = cache.get_seq_length(), cache.context_length
        starts.extend(min(p, M) for p in range(past, past + new_ids.shape[1]))
        logits = drafter.draft_step(new_ids, cache)
        counted = [a - b for a, b in zip(drafter._session.exit_counts, before)]
        assert sum(counted) == 1, counted
        p = cache.get_seq_length() - 1
        records.append((p, logits, cache.tokens.clone(), list(starts), counted.index(1) + 1))

    while n < T - 1:
        cache.crop(min(cache.common_prefix(ids[:, :n]), n - 1))
        del starts[cache.get_seq_length() :]
        drafter.extend_context(cache, context[:, cache.context_length : n - 1])
        step(ids[:, cache.get_seq_length() : n])
        drafts = min(rng.randint(1, 4), T - 1 - n)
        for j in range(drafts - 1):  # feeding the token at position n + j (right, or a wrong one)
            right = rng.random() < 0.7
            token = ids[:, n + j : n + j + 1] if right else torch.randint(3, 128, (1, 1))
            step(token)
        n += rng.randint(0, drafts) + 1
    return records, context


def _check_chain(drafter, records, context, exit=None):
    """Every record's logits equal the parallel forward's at its exit (`exit`, else the one it left at), over the
    tokens and cycle starts it saw."""
    for p, logits, tokens, starts, left in records:
        starts = torch.tensor([starts[: p + 1]])  # [1, p+1]
        with torch.no_grad():
            out = drafter(tokens[:, : p + 1], context=context[:, : p + 1], cycle_starts=starts)
        k = exit or left
        assert exit is None or left == exit
        assert_close(logits, out.exit_logits[k - 1][:, p], msg=f"pos {p}")


def _median_thresholds(drafter, target, seed):
    """Thresholds that split the tokens: the median top probability of each exit before the last."""
    thresholds = []
    for k in range(1, K):
        drafter.config.exit_thresholds = fixed_exit_thresholds(k, K)
        records, _ = _simulate_chain(drafter, target, seed)
        thresholds.append(float(torch.stack([_top(r[1][0]) for r in records]).median()))
    return thresholds


@pytest.mark.parametrize("exit", [1, 2, 3])
def test_chain_at_fixed_exit_equals_forward(exit):
    target = make_target("llama")
    drafter = sorted_drafter(target, K)
    drafter.config.exit_thresholds = fixed_exit_thresholds(exit, K)
    with drafter.attached(target), torch.no_grad():
        records, context = _simulate_chain(drafter, target, seed=exit)
        _check_chain(drafter, records, context, exit=exit)
    assert any(r[2].shape[1] - 1 > r[0] or len(set(r[3])) < len(r[3]) for r in records)  # rejections, cycles


@pytest.mark.parametrize("seed", [0, 1])
def test_chain_adaptive_equals_forward_at_each_exit(seed):
    """Random thresholds: tokens leave at every exit, deeper blocks catch up lazily, logits stay exact."""
    target = make_target("qwen2")
    drafter = sorted_drafter(target, K, seed=seed)
    with drafter.attached(target), torch.no_grad():
        drafter.config.exit_thresholds = _median_thresholds(drafter, target, seed)
        records, context = _simulate_chain(drafter, target, seed=seed + 10)
        _check_chain(drafter, records, context)
    assert {r[4] for r in records} == {1, 2, 3}, [r[4] for r in records]


def test_recording_exit_tops_keeps_the_drafts_and_matches_every_exit():
    """While recording, each drafting step also gives every exit's top-1 and top probability (those of the parallel
    forward at that exit), the exit the token left at, and the same drafted logits as without recording."""
    target = make_target("qwen2")
    drafter = sorted_drafter(target, K, seed=0)
    with drafter.attached(target), torch.no_grad():
        drafter.config.exit_thresholds = _median_thresholds(drafter, target, 0)
        torch.manual_seed(10)  # the wrong tokens fed
        plain, _ = _simulate_chain(drafter, target, seed=10)
        torch.manual_seed(10)
        with drafter.recording_exit_tops() as tops:
            recorded, context = _simulate_chain(drafter, target, seed=10)
        assert drafter.sorted_exits.tops is None  # recording stops with the block
        assert len(tops) == len(recorded) == len(plain)
        for (p, logits, tokens, starts, left), (_, plain_logits, *_), top in zip(recorded, plain, tops):
            assert_close(logits, plain_logits)
            assert top["position"] == p + 1 and int(top["exit"][0]) == left
            assert top["top1"].shape == top["confidence"].shape == (1, K)
            out = drafter(
                tokens[:, : p + 1], context=context[:, : p + 1], cycle_starts=torch.tensor([starts[: p + 1]])
            )
            for k in range(K):
                exit_logits = out.exit_logits[k][0, p]  # [V]
                assert int(top["top1"][0, k]) == int(exit_logits.argmax())
                assert_close(top["confidence"][0, k], _top(exit_logits))
    assert {int(t["exit"][0]) for t in tops} == {1, 2, 3}
    with pytest.raises(ValueError, match="num_blocks > 1"):
        with moa_hf.build_drafter(target).recording_exit_tops():
            pass


def test_none_thresholds_draft_with_the_last_exit():
    target = make_target("llama")
    drafter = sorted_drafter(target, K)
    with drafter.attached(target), torch.no_grad():
        records, context = _simulate_chain(drafter, target, seed=5, T=12)
        _check_chain(drafter, records, context, exit=K)


# ---------------------------------------------------------------------------------------------- tree drafting
@pytest.fixture(params=["exit1", "exit2", "exit3", "adaptive"])
def tree_drafter(request):
    target = make_target("llama")
    drafter = sorted_drafter(target, K, seed=3)
    if request.param == "adaptive":
        drafter.config.exit_thresholds = [0.045, 0.05]  # about half the nodes leave at each exit (seed 3)
    else:
        drafter.config.exit_thresholds = fixed_exit_thresholds(int(request.param[-1]), K)
    with drafter.attached(target):
        yield target, drafter, request.param


def test_tree_nodes_equal_the_chain(tree_drafter):
    """Every node of trees over a left-padded batch, across cycles (accepted paths fed back by the catch-up), equals
    the chain's logits along its path; the state tells the exit of every root and node."""
    target, drafter, kind = tree_drafter
    g, rng = torch.Generator().manual_seed(1), random.Random(1)
    seqs = _prompts((5, 9, 3), seed=1)
    state, starts, exits = drafter.tree_start(len(seqs)), [0, 0, 0], []
    for cycle in range(3):
        logits = _catch_up(target, drafter, state, seqs, starts, g)
        exits.append(state.root_exits[:, None])  # [B, 1]
        for b, seq in enumerate(seqs):
            assert_close(logits[b], _chain(target, drafter, seq))
        tree = _Tree(drafter, state, torch.tensor([len(s) - 1 for s in seqs]), g)
        for depth in range(len(TREE)):
            tree.step(_parents(depth, len(seqs)))
            exits.append(state.node_exits)  # [B, k]
        tree.check(target, seqs)
        drafter.tree_end(state)
        starts = [len(s) for s in seqs]
        accepted = [rng.choice([[], *[p for p in tree.paths(b) if p]]) for b in range(len(seqs))]
        accepted[cycle % 2] = max((p for p in tree.paths(cycle % 2) if p), key=len)
        seqs = [s + a + [rng.randrange(3, 128)] for s, a in zip(seqs, accepted)]
    exits = torch.cat(exits, dim=1)  # [B, evaluations]
    assert set(exits.flatten().tolist()) == ({1, 2, 3} if kind == "adaptive" else {int(kind[-1])})


def test_tree_select_rows_keeps_pending_blocks(tree_drafter):
    target, drafter, _ = tree_drafter
    g = torch.Generator().manual_seed(2)
    seqs = _prompts((7, 4, 10), seed=2)
    state = drafter.tree_start(3)
    _catch_up(target, drafter, state, seqs, [0, 0, 0], g)
    tree = _Tree(drafter, state, torch.tensor([len(s) - 1 for s in seqs]), g)
    tree.step(_parents(0, 3))
    tree.select(torch.tensor([2, 0]))
    seqs = [seqs[2], seqs[0]]
    tree.step(_parents(1, 2))
    tree.check(target, seqs)


# ---------------------------------------------------------------------------------------------- several targets
def test_targets_parts_and_selection():
    target = make_target("llama")
    tuned = _perturbed(target)
    drafter = _two_target_drafter(target, tuned, lora_rank=2)
    assert drafter.target_names == [PRIMARY_TARGET, "tuned"] and isinstance(drafter.target_parts.tuned, MoATargetParts)
    spec = drafter.config.extra_targets["tuned"]
    assert spec["lora_rank"] == 2 and spec["target_fingerprint"] == moa_hf.target_fingerprint(tuned)
    parts = drafter.target_part_parameters("tuned")
    linears = sum(1 for m in drafter.modules() if isinstance(m, torch.nn.Linear)) - 3  # not the LSA's, Ekv2E, head
    assert len(parts) == 1 + 2 * (linears - 7)  # lsa_in_proj + (A, B) per linear of the K SA/CA blocks
    assert drafter.target_part_parameters(PRIMARY_TARGET) == [drafter.lsa_in_proj.weight]
    ids = torch.randint(3, 128, (1, 10))
    target_kv = gather_target_kv(target(ids, past_key_values=DynamicCache()).past_key_values, 0, 10)
    with drafter.attached(target):
        assert drafter.active_target == PRIMARY_TARGET
        main = drafter(ids, target_kv=target_kv).logits
        other = drafter(ids, target_kv=target_kv, target_name="tuned").logits
        assert drafter.active_target == PRIMARY_TARGET and not torch.allclose(main, other)
        drafter.select_target("tuned")
        torch.testing.assert_close(drafter(ids, target_kv=target_kv).logits, other)
    with drafter.attached(tuned):
        assert drafter.active_target == "tuned"
    assert drafter.active_target == "tuned"  # detach keeps the choice
    with pytest.raises(ValueError, match="already serves"):
        drafter.add_target("tuned", tuned)
    with pytest.raises(ValueError, match="signature differs"):
        drafter.add_target("other", make_target("llama", num_hidden_layers=2))
    with pytest.raises(ValueError, match="'main' .*'tuned'"):
        drafter.select_target("nope")


def test_new_target_starts_as_the_primary():
    """A target just added (zero deltas, the primary's LSA projection) drafts exactly as the primary."""
    target = make_target("llama")
    drafter = sorted_drafter(target, K, lsa_hidden_size=32)
    drafter.add_target("tuned", _perturbed(target), lora_rank=4)
    ids = torch.randint(3, 128, (1, 10))
    target_kv = gather_target_kv(target(ids, past_key_values=DynamicCache()).past_key_values, 0, 10)
    with drafter.attached(target), torch.no_grad():
        for k, logits in enumerate(drafter(ids, target_kv=target_kv, target_name="tuned").exit_logits):
            torch.testing.assert_close(logits, drafter(ids, target_kv=target_kv).exit_logits[k])


def test_unknown_target_is_refused_listing_the_known_ones():
    target = make_target("llama")
    drafter = _two_target_drafter(target, _perturbed(target))
    stranger = _perturbed(target, seed=7)
    known = "'main' \\(tiny-random-llama\\), 'tuned' \\(tiny-random-llama-tuned1\\)"
    with pytest.raises(ValueError, match=f"other weights.*{known}"):
        drafter.attach(stranger)
    with drafter.attached(stranger, allow_other_target=True):
        assert drafter.active_target == PRIMARY_TARGET


def test_save_load_round_trip_with_targets(tmp_path):
    target = make_target("llama")
    tuned = _perturbed(target)
    drafter = _two_target_drafter(target, tuned, lora_rank=3)
    drafter.config.exit_thresholds = [0.04, 0.05]
    drafter.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "target_parts.tuned.lsa_in_proj.weight" in keys
    assert "target_parts.tuned.lora.blocks__1__cross_attention__mlp__down_proj.B" in keys
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert loaded.config.extra_targets == drafter.config.extra_targets
    assert loaded.config.exit_thresholds == [0.04, 0.05]
    assert loaded.state_dict().keys() == drafter.state_dict().keys()
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    ids = torch.randint(3, 128, (1, 10))
    target_kv = gather_target_kv(tuned(ids, past_key_values=DynamicCache()).past_key_values, 0, 10)
    with drafter.attached(tuned), loaded.attached(tuned), torch.no_grad():
        assert loaded.active_target == "tuned"
        torch.testing.assert_close(loaded(ids, target_kv=target_kv).logits, drafter(ids, target_kv=target_kv).logits)


def test_per_target_exit_thresholds(tmp_path):
    """Each target drafts with its own thresholds when it has them (else the primary's); an override wins over both
    while it holds; they survive save/load and are validated."""
    target = make_target("llama")
    tuned = _perturbed(target)
    drafter = _two_target_drafter(target, tuned)
    assert drafter.exit_thresholds_for("tuned") is None  # nothing tuned yet: the last exit
    drafter.set_exit_thresholds(fixed_exit_thresholds(1, K))
    assert drafter.exit_thresholds_for("tuned") == fixed_exit_thresholds(1, K)  # the primary's serve it
    drafter.set_exit_thresholds(fixed_exit_thresholds(3, K), target="tuned")
    assert drafter.config.extra_targets["tuned"]["exit_thresholds"] == [2.0, 2.0]
    with pytest.raises(ValueError, match="num_blocks - 1 = 2"):
        drafter.set_exit_thresholds([0.5], target="tuned")
    with pytest.raises(ValueError, match="Unknown target 'nope'"):
        drafter.set_exit_thresholds([0.5, 0.5], target="nope")
    for model, exit in ((target, 1), (tuned, 3)):  # attach picks the target, and with it its thresholds
        with drafter.attached(model), torch.no_grad():
            records, context = _simulate_chain(drafter, model, seed=exit, T=12)
            _check_chain(drafter, records, context, exit=exit)
            with drafter.override_exit_thresholds(fixed_exit_thresholds(2, K)):
                records, context = _simulate_chain(drafter, model, seed=exit, T=12)
                _check_chain(drafter, records, context, exit=2)
            assert drafter.exit_thresholds_for() == fixed_exit_thresholds(exit, K)  # the override lifted
    drafter.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert loaded.exit_thresholds_for("tuned") == [2.0, 2.0] and loaded.exit_thresholds_for("main") == [0.0, 0.0]
    loaded.set_exit_thresholds(None, target="tuned")  # back to the primary's
    assert "exit_thresholds" not in loaded.config.extra_targets["tuned"]
    assert loaded.exit_thresholds_for("tuned") == [0.0, 0.0]
    bad = {**drafter.config.extra_targets["tuned"], "exit_thresholds": [0.1]}
    with pytest.raises(ValueError, match="num_blocks - 1 = 2"):
        moa_hf.build_drafter(target, num_blocks=K, extra_targets={"tuned": bad})


# ---------------------------------------------------------------------------------------------- lossless drafting
def _lossless_setup():
    target = make_target("llama")
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(8.0)  # peaked: drafts get accepted at times
    tuned = _perturbed(target, noise=0.01)
    drafter = _two_target_drafter(target, tuned, lookup_num_tokens=4)
    drafter.config.exit_thresholds = [0.8, 0.93]  # about the median top probability of exits 1 and 2
    drafter.generation_config.assistant_confidence_threshold = 0.0
    return target, tuned, drafter


@pytest.mark.parametrize("which", ["main", "tuned"])
def test_assisted_generation_is_lossless_for_both_targets(which):
    target, tuned, drafter = _lossless_setup()
    model = target if which == "main" else tuned
    prompts = [torch.tensor([[5, 9, 17, 33, 5, 9, 17]]), torch.randint(3, 128, (1, 6))]
    counts = [0] * K
    with moa_hf.attached(drafter, model):
        assert drafter.active_target == which
        for ids in prompts:
            ref = model.generate(ids, max_new_tokens=24, do_sample=False)
            out = model.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter)
            assert torch.equal(out, ref)
            stats = drafter.speculation_stats
            assert len(stats.exit_counts) == K and stats.as_dict()["exit_counts"] == stats.exit_counts
            assert sum(stats.exit_counts) == stats.drafted_tokens - stats.lookup_tokens > 0
            counts = [a + b for a, b in zip(counts, stats.exit_counts)]
    assert sum(c > 0 for c in counts) >= 2, counts


@pytest.mark.parametrize("which", ["main", "tuned"])
def test_engine_is_lossless_for_both_targets(which):
    target, tuned, drafter = _lossless_setup()
    model = target if which == "main" else tuned
    prompts = [torch.tensor([5, 9, 17, 33, 5, 9, 17, 33, 5]), torch.randint(3, 128, (6,))]
    refs = [model.generate(p[None], max_new_tokens=20, do_sample=False)[0, p.shape[0] :] for p in prompts]
    settings = dict(tree_depth=3, tree_top_k=3, tree_budget=8, costs=FLAT_COSTS, do_sample=False, max_new_tokens=20)
    ids = torch.zeros(2, 9, dtype=torch.long)
    ids[0], ids[1, 3:] = prompts[0], prompts[1]
    mask = (ids != 0).long()
    out = moa_hf.generate(model, drafter, ids, attention_mask=mask, return_dict_in_generate=True, **settings)
    for b, ref in enumerate(refs):
        assert out.sequences[b, 9:].tolist() == ref.tolist(), f"row {b}"
    for stats in out.speculation_stats:
        assert len(stats.exit_counts) == K and "exit_counts" in stats.as_dict()
        assert sum(stats.exit_counts) == stats.drafted_tokens - stats.lookup_tokens > 0
    total = [sum(column) for column in zip(*(stats.exit_counts for stats in out.speculation_stats))]
    assert sum(c > 0 for c in total) >= 2, total
    assert not drafter.is_attached


REMOTE_SCRIPT = textwrap.dedent(
    """
    import sys, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "moa_hf" or name.startswith("moa_hf."):
                raise ImportError("moa_hf is blocked in this test")
    sys.meta_path.insert(0, Block())
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    tuned = AutoModelForCausalLM.from_pretrained(sys.argv[2]).eval()
    drafter = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
    assert type(drafter.blocks[0]).__name__ == "MoABlock" and drafter.target_names == ["main", "tuned"]
    drafter.attach(tuned)
    assert drafter.active_target == "tuned"
    ids = torch.tensor([[5, 9, 17, 33, 5, 9]])
    ref = tuned.generate(ids, max_new_tokens=16, do_sample=False)
    out = tuned.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=drafter)
    assert torch.equal(ref, out), (ref, out)
    stats = drafter.speculation_stats
    assert len(stats.exit_counts) == 3 and sum(stats.exit_counts) == stats.drafted_tokens - stats.lookup_tokens
    drafter.detach()
    print("REMOTE-OK", stats.exit_counts)
    """
)


def test_remote_code_loads_a_sorted_two_target_drafter(tmp_path):
    target, tuned, drafter = _lossless_setup()
    tuned.generation_config.eos_token_id = None
    drafter.save_pretrained(tmp_path / "drafter")
    tuned.save_pretrained(tmp_path / "tuned")
    script = tmp_path / "remote.py"
    script.write_text(REMOTE_SCRIPT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "drafter"), str(tmp_path / "tuned")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REMOTE-OK" in proc.stdout
