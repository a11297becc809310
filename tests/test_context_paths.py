"""How more of the target's state reaches a MoA drafter: context vectors that also read the target's final hidden
states (`context_final_hidden`), and the newest verified context added to the CA's input (`ca_latest_context`).
What the drafting call of assisted generation reads (the verified tokens' states only, as the parallel forward does),
exact generation, training on cached states as on the live target, the server's sessions, saving, and the errors
that name what is missing. The engine's tree drafting with them is checked in tests/test_tree_drafter.py and
tests/test_engine_drafters.py, chain drafting against the parallel forward in tests/test_modeling.py."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

import moa_hf
from moa_hf.modeling import CACHE_NAME, MoADrafterCache, MoADrafterModel, TargetStates, gather_target_kv
from moa_hf.training import MoATrainer
from moa_hf.training.states import TargetStatesDataset, cache_target_states

from factory import make_target, random_dataset, tiny_target
from factory import tiny_training_args as make_args
from tolerance import assert_close

torch.set_num_threads(1)


def _drafter(target, seed=0, **overrides):
    torch.manual_seed(seed)
    drafter = moa_hf.build_drafter(target, context_final_hidden=True, **overrides).eval()
    with torch.no_grad():
        drafter.Eh2E.weight.normal_(0.0, 0.5)  # large enough that the hidden states move the logits
        if drafter.config.ca_latest_context:
            drafter.cross_attention.latest_proj.weight.normal_(0.0, 0.5)
    return drafter


def _states(target, ids):
    """The target over `ids`: its per-layer keys/values [1, T, L, W] and post-norm final hidden states [1, T, D]."""
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        out = target(ids, use_cache=True, output_hidden_states=True, **{CACHE_NAME: cache})
    return gather_target_kv(cache, 0, ids.shape[1]), out.hidden_states[-1]


def test_drafting_call_reads_the_verified_tokens_final_hidden_states():
    """The drafting call of assisted generation gives the logits of the parallel forward fed the target's keys/values
    and final hidden states, at the positions a cycle starting at the bonus token reads (verified 0..n-2)."""
    target = make_target("qwen2")
    drafter = _drafter(target).attach(target)
    n, k = 9, 4
    ids = torch.randint(3, 128, (1, n))
    with torch.no_grad():
        target(ids[:, :-1], use_cache=True, **{CACHE_NAME: DynamicCache(config=target.config)})  # the hooks see it
        gc = GenerationConfig(do_sample=False, assistant_confidence_threshold=0.0)
        out = drafter.generate(ids, generation_config=gc, max_new_tokens=k, **{CACHE_NAME: MoADrafterCache()})
        full = out.sequences
        kv, hidden = _states(target, full)
        starts = torch.arange(n + k).clamp(max=n - 1)[None]  # drafted positions: the cycle starts at the bonus token
        ref = drafter(full, target_kv=kv, target_hidden=hidden, cycle_starts=starts).logits
        blind = drafter(full, target_kv=kv, target_hidden=torch.zeros_like(hidden), cycle_starts=starts).logits
    assert_close(torch.stack(out.scores, 1), ref[:, n - 1 : n - 1 + k])
    assert (blind - ref)[:, n - 1 :].abs().max() > 1e-3  # the hidden states matter: the check can fail


@pytest.mark.parametrize("family", ["llama", "mistral-sliding"])
@pytest.mark.parametrize("latest", [False, True])
def test_assisted_generation_stays_exact(family, latest):
    target = make_target(family)
    drafter = _drafter(target, ca_latest_context=latest).attach(target)
    ids = torch.randint(3, 128, (1, 14))
    with torch.no_grad():
        plain = target.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=0)
        assisted = target.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=0, assistant_model=drafter)
        again = target.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=0, assistant_model=drafter)
    assert torch.equal(plain, assisted) and torch.equal(plain, again)  # a second call starts afresh
    assert drafter.speculation_stats.drafted_tokens > 0  # the network drafted (and read the hidden states)


def test_missing_hidden_states_are_named():
    target = make_target("llama")
    drafter = _drafter(target)
    kv, _ = _states(target, torch.randint(3, 128, (1, 6)))
    with pytest.raises(ValueError, match="final_hidden"):
        drafter.compute_context(TargetStates(kv))
    with pytest.raises(ValueError, match="prev_hidden"):
        state = drafter.attach(target).tree_start(1)
        drafter.tree_catch_up(state, torch.tensor([[5]]), torch.tensor([[0]]), torch.ones(1, 1, dtype=torch.bool),
                              torch.tensor([[-1]]), DynamicCache())  # fmt: skip
    assert drafter.needs_target_hidden and not moa_hf.build_drafter(target).needs_target_hidden


def test_trains_on_cached_states_like_online_and_saves(tmp_path):
    """The same steps on cached (bf16) states and on the live target give the same losses up to bf16 rounding; the
    hidden states' projection learns; the saved drafter keeps it."""
    target = tiny_target()
    data = random_dataset(8)
    folder = cache_target_states(target, data, tmp_path / "states", progress=False)
    curves = []
    for train in (data, TargetStatesDataset(data, folder)):
        torch.manual_seed(0)
        drafter = moa_hf.build_drafter(target, context_final_hidden=True)
        before = drafter.Eh2E.weight.detach().clone()
        trainer = MoATrainer(model=drafter, target=target, args=make_args(tmp_path, max_steps=3), train_dataset=train)
        trainer.train()
        curves.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
        assert not torch.equal(drafter.Eh2E.weight, before)
    assert len(curves[0]) == 3
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=2e-2, atol=1e-3)
    drafter.save_pretrained(tmp_path / "saved")
    loaded = MoADrafterModel.from_pretrained(tmp_path / "saved")
    assert loaded.config.context_final_hidden and torch.equal(loaded.Eh2E.weight, drafter.Eh2E.weight)


# -- the server (client-server decoding): its sessions' caches record the hidden states ---------------------------
@pytest.mark.parametrize("family", ["llama", "mistral-sliding"])
def test_server_forwards_record_the_hidden_states_of_kept_positions(family):
    """`batched_forward` over `HiddenRecordingCache`s, rows together or alone, after a crop: each cache holds the
    final hidden states of the target run over its whole sequence at once."""
    from moa_hf.serving.batching import batched_forward
    from moa_hf.serving.target_hidden import HiddenRecordingCache

    target = make_target(family)
    g = torch.Generator().manual_seed(0)
    firsts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (6, 13, 1)]
    inputs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 1, 5)]
    for together in (True, False):
        caches = [HiddenRecordingCache(config=target.config) for _ in firsts]
        for c in caches:
            c.activate_past_recording()  # as the server keeps them: a crop past a sliding window rolls back
        with torch.no_grad():
            for c, x in zip(caches, firsts):
                batched_forward(target, [c], [x + [9]], [1])
                c.crop(-1)  # a rejected draft: its hidden state goes with its keys/values
            if together:
                batched_forward(target, caches, inputs, [1, 1, 1])
            else:
                for c, x in zip(caches, inputs):
                    batched_forward(target, [c], [x], [1])
            for c, a, b in zip(caches, firsts, inputs):
                hidden = target(torch.tensor([a + b]), output_hidden_states=True).hidden_states[-1]  # [1, T, D]
                assert c.final_hidden.shape[0] == c.get_seq_length() == len(a) + len(b)
                assert_close(c.final_hidden, hidden[0])


def test_server_context_reads_the_hidden_states_and_client_decoding_stays_exact():
    import httpx

    from moa_hf.serving import MoAClient, ServerThread, ServingState, create_app
    from moa_hf.serving.protocol import decode_result

    target = make_target("llama")
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target, own_embeddings=True, context_final_hidden=True).eval()
    with torch.no_grad():
        drafter.Eh2E.weight.normal_(0.0, 0.5)
    state = ServingState(target, drafter)
    with ServerThread(create_app(state)) as srv:
        prompt = [5, 17, 33, 9]
        body = {"input_ids": prompt, "draft_ids": [7, 8], "context_format": "fp32"}
        first = decode_result(httpx.post(f"{srv.url}/v1/sessions", json=body).content)
        verified = prompt + [7, 8][: first.accepted] + [first.next_token]
        body = {"num_verified": len(verified), "last_token": verified[-1], "draft_ids": [3, 4, 5]}
        body["context_format"] = "fp32"
        second = decode_result(httpx.post(f"{srv.url}/v1/sessions/{first.session_id}/verify", json=body).content)
        verified += [3, 4, 5][: second.accepted] + [second.next_token]
        kv, hidden = _states(target, torch.tensor([verified[:-1]]))
        with torch.no_grad():
            expected = drafter.compute_context(TargetStates(kv, final_hidden=hidden))[0]  # [n-1, d]
        got = torch.cat([first.context, second.context])[: len(verified) - 1]
        assert_close(got, expected)
        with MoAClient(srv.url, drafter=drafter) as client:
            for p in ([5, 6, 7, 5, 6, 7], [40, 41]):
                result = client.generate(p, max_new_tokens=20)
                ref = target.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p) :]
                assert result.token_ids == ref.tolist()
    state.close()
