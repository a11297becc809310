"""A MoA block drafter (`block_size` k > 1): one forward over [the last verified token, k-1 placeholders] drafts k
tokens. Its inference routes compute what training's layout computes (float32), and decoding stays exact."""

import pytest
import torch
from transformers import DynamicCache

import moa_hf
from moa_hf.modeling import MoADrafterCache, MoADrafterConfig, TargetStates, gather_target_kv

from factory import make_target
from tolerance import assert_close

K = 4


def _drafter(target, **overrides):
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target, block_size=K, **overrides)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
        drafter.block_embedding.normal_(0.0, 1.0)
    return drafter.eval()


def _states(target, ids):
    cache = DynamicCache()
    with torch.no_grad():
        target(ids, past_key_values=cache, use_cache=True)
    return TargetStates(kv=gather_target_kv(cache, 0, ids.shape[1]))


@pytest.mark.parametrize("latest", [False, True])
def test_a_block_at_inference_equals_training_layout(latest):
    """A chain's block forward after n verified tokens gives, at slots 0..k-1, the logits of the training forward
    with an anchor at n-1 (placeholder slots appended after the sequence) and of its sequence position n-1."""
    target = make_target("llama")
    drafter = _drafter(target, ca_latest_context=latest).attach(target)
    T, n = 20, 11
    ids = torch.randint(3, 128, (1, T))
    states = _states(target, ids)
    with torch.no_grad():
        context = drafter.compute_context(states)
        starts = torch.arange(T).clamp(max=n - 1)[None]  # position n-1 starts a cycle: it reads context < n-1
        anchors = torch.tensor([[n - 1, 3, -1]])  # the anchor under test, another one, and none
        out = drafter(ids, context=context, cycle_starts=starts, block_anchors=anchors)
        assert out.logits.shape[1] == T + 3 * (K - 1)
        cache = MoADrafterCache()
        drafter.extend_context(cache, context[:, : n - 1])
        first = drafter.draft_step(ids[:, :n], cache)  # the block forward: slot 0
        rows = [first] + [drafter.draft_step(ids[:, n + j : n + j + 1], cache) for j in range(K - 1)]
        assert len(cache.block_fed) == K - 1 and cache.get_seq_length() == n  # drafted tokens fed no forward
    assert_close(rows[0], out.logits[:, n - 1])
    for j in range(1, K):
        assert_close(rows[j], out.logits[:, T + j - 1])  # anchor 0's slots come first


def test_a_block_beyond_its_end_drafts_a_second_block():
    """Past k tokens the chain route feeds the drafted tokens as slots and drafts the next block (still exact)."""
    target = make_target("llama")
    drafter = _drafter(target).attach(target)
    T, n = 24, 9
    ids = torch.randint(3, 128, (1, T))
    with torch.no_grad():
        context = drafter.compute_context(_states(target, ids))
        cache = MoADrafterCache()
        drafter.extend_context(cache, context[:, : n - 1])
        drafter.draft_step(ids[:, :n], cache)
        for j in range(K - 1):
            drafter.draft_step(ids[:, n + j : n + j + 1], cache)
        second = drafter.draft_step(ids[:, n + K - 1 : n + K], cache)  # a new block at position n+k-1
        assert cache.get_seq_length() == n + K and not cache.block_fed
        starts = torch.arange(T).clamp(max=n - 1)[None]
        ref = drafter(ids, context=context, cycle_starts=starts, block_anchors=torch.tensor([[n + K - 1]]))
    assert_close(second, ref.logits[:, n + K - 1])


def test_tree_catch_up_drafts_the_block_of_the_chain():
    """The engine's catch-up runs the block forward; `tree_step` at depths 1..k-1 reads its rows (no forward), for
    every row of a left-padded batch, as the chain route drafts them."""
    target = make_target("llama")
    drafter = _drafter(target).attach(target)
    seqs = [torch.randint(3, 128, (n,)).tolist() for n in (7, 12)]
    T = 12
    ids = torch.tensor([[0] * (T - len(s)) + s for s in seqs])
    mask = (torch.arange(T)[None] >= torch.tensor([T - len(s) for s in seqs])[:, None]).long()
    cache = DynamicCache()
    with torch.no_grad():
        target(ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0), past_key_values=cache)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        prev = torch.where(mask.bool(), torch.arange(T)[None] - 1, -1)  # the previous position's slot
        prev = torch.where(positions > 0, prev, -1)
        state = drafter.tree_start(2)
        root = drafter.tree_catch_up(state, ids, positions, mask.bool(), prev, cache)
        depth = [drafter.tree_step(state, torch.full((2, 1), 5), positions[:, -1:] + d, torch.full((2, 1), -1))
                 for d in range(1, K)]  # fmt: skip
        for b, seq in enumerate(seqs):
            chain_cache = MoADrafterCache()
            seq_states = _states(target, torch.tensor([seq]))
            drafter.extend_context(chain_cache, drafter.compute_context(seq_states)[:, : len(seq) - 1])
            rows = [drafter.draft_step(torch.tensor([seq]), chain_cache)]
            rows += [drafter.draft_step(torch.tensor([[5]]), chain_cache) for _ in range(K - 1)]
            assert_close(root[b], rows[0][0])
            for d in range(1, K):
                assert_close(depth[d - 1][b, 0], rows[d][0])
        with pytest.raises(ValueError, match="draft_depth_limit"):
            drafter.tree_step(state, torch.full((2, 1), 5), positions[:, -1:] + K, torch.full((2, 1), -1))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_decoding_is_exact_on_every_route(family):
    """float32 greedy: `assistant_model` (blocks of k, and chains past them), the engine (chains and trees capped at
    depth k) give the target's own tokens."""
    target = make_target(family)
    drafter = _drafter(target)
    ids = torch.randint(3, 128, (1, 9))
    ref = target.generate(ids, max_new_tokens=30, do_sample=False)
    with moa_hf.attached(drafter, target):
        for n in (K, 2 * K + 1):
            drafter.generation_config.num_assistant_tokens = n
            drafter.generation_config.assistant_confidence_threshold = 0.0
            out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter)
            assert torch.equal(out, ref)
    for shape in ({"tree_top_k": 1, "tree_depth": 6, "tree_budget": 6}, {"tree_top_k": 3, "tree_depth": 6}):
        out = moa_hf.generate(target, drafter, input_ids=ids, max_new_tokens=30, do_sample=False, lookup=False,
                              **shape)  # fmt: skip
        assert torch.equal(out, ref)


def test_block_size_is_checked():
    target = make_target("llama")
    config = moa_hf.build_drafter(target).config.to_dict()
    with pytest.raises(ValueError, match="block_size"):
        MoADrafterConfig(**{**config, "block_size": 0})
    with pytest.raises(ValueError, match="num_blocks=1 and target_layer_inference=0"):
        MoADrafterConfig(**{**config, "block_size": 4, "num_blocks": 2})
    assert moa_hf.build_drafter(target, block_size=K).draft_depth_limit == K
    assert moa_hf.build_drafter(target).draft_depth_limit is None


def test_training_a_block_drafter_learns_its_placeholder_slots(tmp_path):
    """`MoATrainer` trains each simulated cycle's block beside the chain positions: the loss counts the placeholder
    slots (it changes with their embedding), gradients reach the block embedding, and a few steps lower the loss."""
    from moa_hf.training import MoATrainer

    from factory import random_dataset, tiny_target, tiny_training_args

    target = tiny_target(logit_scale=8.0)
    data = random_dataset(8, seed=4)
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target, block_size=K)
    trainer = MoATrainer(
        model=drafter, target=target, args=tiny_training_args(tmp_path, max_steps=20), train_dataset=data
    )
    batch = trainer.data_collator([{**data[i], "sample_index": i} for i in range(8)])
    model = trainer.model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    assert drafter.block_embedding.grad is not None and drafter.block_embedding.grad.abs().sum() > 0
    with torch.no_grad():
        drafter.block_embedding.add_(1.0)
        assert trainer.compute_loss(model, batch).item() != pytest.approx(loss.item())
        drafter.block_embedding.sub_(1.0)
    model.zero_grad()
    trainer.train()
    with torch.no_grad():
        assert trainer.compute_loss(model.eval(), batch).item() < loss.item()


def test_client_server_decoding_with_a_block_drafter_is_exact(tmp_path, monkeypatch):
    """The serving client drafts blocks (one forward per k tokens, a new block after each verification) and gives
    the target's greedy tokens."""
    from test_serving import char_tokenizer, prompts, reference

    from moa_hf.serving import MoAClient, ServerThread, ServingState, create_app

    monkeypatch.setenv("MOA_HF_DRAFTER_CACHE", str(tmp_path / "drafters"))
    target = make_target("llama")
    drafter = _drafter(target, own_embeddings=True)
    with torch.no_grad():
        drafter.copy_embeddings_from(target)
    with ServerThread(create_app(ServingState(target, drafter, tokenizer=char_tokenizer()))) as server:
        with MoAClient(server.url, drafter=drafter, draft_length=K + 2) as client:
            for i, prompt in enumerate(prompts(2, 3)):
                n = 10 + 7 * i
                result = client.generate(prompt, max_new_tokens=n)
                assert result.token_ids == reference(target, prompt, n)
                assert sum(result.stats["accepted_lengths"]) == n


def test_moa_train_continues_a_chain_drafter_as_a_block_drafter(tmp_path):
    """`moa train --init-from CHAIN --block-size K`: the chain drafter's weights carry over, the placeholder embedding
    starts new and trains, and the saved block drafter decodes exactly (its held-out evaluation drafts blocks)."""
    from moa_hf.training.cli import main

    from factory import random_dataset, tiny_target, tiny_tokenizer

    target = tiny_target(logit_scale=8.0)
    target.save_pretrained(tmp_path / "t")
    tiny_tokenizer().save_pretrained(tmp_path / "t")
    random_dataset(8).save_to_disk(str(tmp_path / "d"))
    torch.manual_seed(0)
    chain = moa_hf.build_drafter(target)
    chain.save_pretrained(tmp_path / "chain")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n')
    args = [
        "train", "--dtype", "float32", "--batch-size", "4", "--eval-prompts", str(prompts), "--eval-num-prompts", "1",
        "--eval-max-new-tokens", "6", "--save-steps", "100", "--quiet", "--cpu", "--target", str(tmp_path / "t"),
        "--data", str(tmp_path / "d"), "--init-from", str(tmp_path / "chain"), "--block-size", "3", "--max-steps", "2",
        "--output", str(tmp_path / "block"),
    ]  # fmt: skip
    assert main(args) == 0
    block = moa_hf.MoADrafterModel.from_pretrained(tmp_path / "block")
    assert block.config.block_size == 3 and block.block_embedding.abs().sum() > 0
    shared = set(chain.state_dict()) & set(block.state_dict())
    assert shared == set(chain.state_dict()) and "block_embedding" in block.state_dict()
    ids = torch.randint(3, 100, (1, 7))
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    with moa_hf.attached(block, target):
        assert torch.equal(target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=block), ref)


def test_a_markov_head_biases_each_slot_by_the_token_before_it(tmp_path):
    """`block_markov_rank`: every route adds to slot j's logits the bias of the token drafted before it (training:
    the real one), so a tree's children at one depth differ by their parent; gradients reach the head."""
    from moa_hf.training import MoATrainer

    from factory import random_dataset, tiny_target, tiny_training_args

    target = make_target("llama")
    drafter = _drafter(target, draft_vocab_size=64, block_markov_rank=8).attach(target)
    with torch.no_grad():
        drafter.markov_out.weight.normal_(0.0, 1.0)
    T, n = 20, 11
    ids = torch.randint(3, 128, (1, T))
    with torch.no_grad():
        context = drafter.compute_context(_states(target, ids))
        starts = torch.arange(T).clamp(max=n - 1)[None]
        out = drafter(ids, context=context, cycle_starts=starts, block_anchors=torch.tensor([[n - 1]]))
        cache = MoADrafterCache()
        drafter.extend_context(cache, context[:, : n - 1])
        drafter.draft_step(ids[:, :n], cache)
        for j in range(1, K):  # the token at position n-1+j, fed as drafted: its row carries its bias
            row = drafter.draft_step(ids[:, n - 1 + j : n + j], cache)
            expected = out.logits[:, T + j - 1] + drafter.markov_bias(ids[:, n - 1 + j])
            assert_close(row, expected)
        rows = drafter.tree_step(cache, torch.tensor([[5, 6]]), torch.tensor([[n, n]]), torch.tensor([[-1, -1]]))
        assert not torch.allclose(rows[0, 0], rows[0, 1])  # two children of the root, two different biases
    with pytest.raises(ValueError, match="draft_vocab_size"):
        moa_hf.build_drafter(target, block_size=K, block_markov_rank=8)

    small = tiny_target(logit_scale=8.0)
    data = random_dataset(8, seed=4)
    trained = moa_hf.build_drafter(small, block_size=K, draft_vocab_size=64, block_markov_rank=8)
    trainer = MoATrainer(model=trained, target=small, args=tiny_training_args(tmp_path), train_dataset=data)
    batch = trainer.data_collator([{**data[i], "sample_index": i} for i in range(8)])
    trainer.compute_loss(trainer.model.train(), batch).backward()
    assert trained.markov_out.weight.grad.abs().sum() > 0


def test_vllm_proposer_route_drafts_one_block_per_step():
    """What vLLM's proposer runs: `tree_catch_up` with a reader function (as it reads the paged cache), states joined
    by `concat_rows`, then `tree_chain`: greedy chains of at most k tokens per row (one block each), the tokens of the
    chain route's block."""
    target = make_target("llama")
    drafter = _drafter(target).attach(target)
    seqs = [torch.randint(3, 128, (n,)).tolist() for n in (6, 10)]
    states, roots = [], []
    with torch.no_grad():
        for seq in seqs:  # one row per state, then joined, as the proposer joins new rows
            ids = torch.tensor([seq])
            cache = DynamicCache()
            target(ids, past_key_values=cache, use_cache=True)
            n = len(seq)
            state = drafter.tree_start(1)
            read = lambda slots, cache=cache, n=n: gather_target_kv(cache, 0, n)[:, slots[0].clamp(min=0)]  # noqa: E731
            prev = (torch.arange(n) - 1)[None]
            roots.append(drafter.tree_catch_up(state, ids, torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool),
                                               prev, read))  # fmt: skip
            states.append(state)
        joined = type(states[0]).concat_rows(states)
        positions = torch.tensor([len(s) for s in seqs])
        chains = drafter.tree_chain(joined, torch.cat(roots), positions, 3 * K)
        drafted = chains.lists()
        for seq, tokens in zip(seqs, drafted):
            assert len(tokens) == K  # capped at one block (`draft_depth_limit`)
            cache = MoADrafterCache()
            drafter.extend_context(
                cache, drafter.compute_context(_states(target, torch.tensor([seq])))[:, : len(seq) - 1]
            )
            want = [int(drafter.draft_step(torch.tensor([seq]), cache).argmax())]
            for _ in range(K - 1):
                want.append(int(drafter.draft_step(torch.tensor([[want[-1]]]), cache).argmax()))
            assert tokens == want


class OracleBlockDrafter(moa_hf.MoADrafterModel):
    """A block drafter whose block rows are an unhooked target copy's (`oracle`) next-token logits after the verified
    tokens and its own greedy continuation: q close to p, so drafts are often accepted. It runs the real block forward
    underneath, keeping every state in use."""

    def block_forward(self, state, tokens, sa_mask, limit, positions):
        super().block_forward(state, tokens, sa_mask, limit, positions)
        seq, rows = state.tokens, []
        with torch.no_grad():
            for _ in range(self.config.block_size):
                rows.append(self.oracle(seq).logits[:, -1].float())
                seq = torch.cat([seq, rows[-1].argmax(-1, keepdim=True)], dim=1)
        logits = torch.stack(rows, dim=1)  # [B, k, V]
        state.block_logits = logits[:, 1:]
        return logits


def test_sampling_with_a_block_drafter_keeps_the_target_distribution():
    """Speculative sampling with a block's rows as the draft distribution keeps the target's (chi-square test on the
    next two tokens, the test the chain drafter passes)."""
    import copy

    from test_generation import _sampled_pairs_p_value, peaky_pair_distribution

    target, ids, joint = peaky_pair_distribution()
    drafter = OracleBlockDrafter(moa_hf.build_drafter(target, block_size=K).config).eval()
    drafter.oracle = copy.deepcopy(target)
    drafter.generation_config.assistant_confidence_threshold = 0.0
    drafter.generation_config.num_assistant_tokens = 2
    p_value, accepted = _sampled_pairs_p_value(target, drafter, ids, joint)
    assert p_value > 1e-3, p_value
    assert accepted > 0  # drafts from the block were really accepted, so speculative sampling was exercised
